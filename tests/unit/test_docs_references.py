"""The docs point at things that exist: every relative link names a file of the repository,
and every test a page or docs/promises.md names as proof (`unit/test_x.py::test_name`, or
`::test_name` after such a path) is a test function in that file. A renamed test or module
would otherwise leave a promise pointing at nothing."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PAGES = sorted(
    [REPO / "README.md", REPO / "bench" / "README.md", REPO / "infra" / "README.md"]
    + list((REPO / "docs").glob("*.md"))
)
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")
# `integration/test_a.py::test_b`, then any `::test_c` that follows it in the same cell.
TEST_REF = re.compile(r"`((?:unit|integration|gpu)/[\w/]+\.py)?::(test_\w+)`")


def relative_links(page: Path) -> list[str]:
    return [
        link for link in LINK.findall(page.read_text()) if not re.match(r"[a-z]+://|mailto:", link)
    ]


def named_tests(page: Path) -> list[tuple[str, str]]:
    """(test file, test name) pairs; a bare `::test_c` belongs to the file named last."""
    pairs = []
    for line in page.read_text().splitlines():
        current = None
        for path, name in TEST_REF.findall(line):
            current = path or current
            if current is not None:
                pairs.append((current, name))
    return pairs


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_relative_link_names_a_file(page: Path) -> None:
    broken = [link for link in relative_links(page) if not (page.parent / link).exists()]
    assert broken == [], f"{page.relative_to(REPO)} links to missing files: {broken}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_test_named_as_proof_exists(page: Path) -> None:
    missing = []
    for path, name in named_tests(page):
        source = REPO / "tests" / path
        if not source.exists() or not re.search(
            rf"^(async )?def {name}\(", source.read_text(), re.MULTILINE
        ):
            missing.append(f"{path}::{name}")
    assert missing == [], f"{page.relative_to(REPO)} names tests that do not exist: {missing}"
