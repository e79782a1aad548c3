"""The repository stands alone: no file cites a document that is not in it.

Notes and design documents kept outside the repository are read by nobody who clones it, so a
comment or a doc that sends the reader to one of them gives that reader nothing. Each reason
is written out where it applies instead. Public sources (a named tutorial, a library's docs)
are fine.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]

# Built from pieces so that this file does not match its own patterns.
_CITATIONS = [
    re.escape("DESIGN" + ".md"),
    r"(?-i:\bDESIGN" + r"(?:'s)? rule|\bDESIGN" + r"'s contract)",
    r"(?-i:FIELD" + r"[-_ ]NOTES)",
    re.escape(".." + "/shared"),
    re.escape("shared" + "/seeds"),
    r"\bseed" + r" 00\d",
    r"\bthe seed" + r"(?:'s|s')",
    r"\bseed" + r" tutorial",
]
CITATION = re.compile("|".join(_CITATIONS), re.IGNORECASE)


def _tracked_files() -> list[Path]:
    if shutil.which("git") is None or not (REPO / ".git").exists():
        pytest.skip("not a git checkout: the tracked files cannot be listed")
    listing = subprocess.run(
        ["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True, timeout=60
    ).stdout
    return [REPO / name for name in listing.decode().split("\0") if name]


def _citations(path: Path) -> list[str]:
    try:
        data = path.read_bytes()
    except (FileNotFoundError, IsADirectoryError):  # deleted but not yet staged; a submodule
        return []
    if b"\0" in data:  # binary (screenshots)
        return []
    text = data.decode("utf-8", errors="replace")
    return [
        f"{path.relative_to(REPO)}:{number}: {line.strip()}"
        for number, line in enumerate(text.splitlines(), start=1)
        if CITATION.search(line)
    ]


def test_no_tracked_file_cites_a_document_outside_the_repository() -> None:
    offenders = [hit for path in _tracked_files() for hit in _citations(path)]
    assert not offenders, (
        "these lines cite a document that is not in the repository; state the reason itself:\n"
        + "\n".join(offenders)
    )


@pytest.mark.parametrize(
    "line",
    [
        "see DESIGN" + ".md",
        "(DESIGN" + " rule 6)",
        "Pins from FIELD" + "-NOTES: newer fastapi",
        "Provenance: /work/shared" + "/seeds/001.txt",
        "lr * world_size (seed" + " 003)",
        "as in the seed" + "'s LSTM",
        "The seed" + " tutorial expanded every name",
    ],
)
def test_the_patterns_catch_each_kind_of_citation(line: str) -> None:
    assert CITATION.search(line)


@pytest.mark.parametrize(
    "line",
    [
        "seed: int = 0",
        "the same seed gives the same split",
        "--seed 0",
        "export DDPFLOW_ARTIFACT_ROOT=/shared/ddpflow/artifacts",
        "Saturn Cloud's pet-name tutorial",
    ],
)
def test_an_rng_seed_or_a_shared_folder_is_not_a_citation(line: str) -> None:
    assert not CITATION.search(line)
