"""The flows' parameter tables in the docs, generated from the parameters' declaration.

`python -m flows.param_docs` rewrites every table between the markers

    <!-- parameters: train-charlm -->
    <!-- end parameters -->

in README.md and docs/*.md from the flow's declared parameters (flows.params for type,
limits and help, flows.defaults for the default); `--check` only reports the files whose
tables differ and exits 1. tests/integration/test_param_declaration.py runs the check, so a table
never drifts from the code.
"""

from __future__ import annotations

import argparse
import re
import sys
import typing
from pathlib import Path
from typing import Any

from flows.param_flow import declared, limits, wire_type
from flows.redacted_flow import RedactedParamsFlow

REPO = Path(__file__).resolve().parents[1]
BLOCK = re.compile(
    r"(<!-- parameters: (?P<flow>[a-z-]+) -->\n)(?P<table>.*?)(<!-- end parameters -->)",
    re.DOTALL,
)


def flows() -> dict[str, RedactedParamsFlow]:
    """Every flow with declared parameters, by flow name."""
    from flows.retrain_charlm import retrain_charlm
    from flows.scaling_charlm import scaling_charlm
    from flows.scaling_images import scaling_images
    from flows.sweep_charlm import sweep_charlm
    from flows.train_charlm import train_charlm
    from flows.train_images import train_images

    found = [train_charlm, retrain_charlm, sweep_charlm, train_images]
    return {f.name: f for f in [*found, scaling_charlm, scaling_images]}


def _type_name(annotation: Any) -> str:
    if annotation is type(None):
        return "unset"
    if isinstance(annotation, type) and not typing.get_args(annotation):
        return annotation.__name__
    if typing.get_args(annotation) and typing.get_origin(annotation) in (dict, list):
        return "JSON " + ("object" if typing.get_origin(annotation) is dict else "list")
    return " or ".join(_type_name(a) for a in typing.get_args(annotation))


def _default(value: Any) -> str:
    if value is None:
        return "unset"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, str) and Path(value).is_absolute() and Path(value).is_relative_to(REPO):
        return f"`{Path(value).relative_to(REPO)}`"  # the shipped data, wherever the clone is
    if isinstance(value, float):
        return f"`{value:g}`"
    return f"`{value}`"


def table(flow: RedactedParamsFlow) -> str:
    """The flow's parameters as a markdown table, one row per parameter, in order."""
    parameters = declared(flow)
    rows = [
        "| parameter | type | default | allowed | meaning |",
        "|---|---|---|---|---|",
    ]
    for name, default in parameters.defaults.items():
        info = parameters.fields[name]
        kind = _type_name(wire_type(info.annotation))
        meaning = str(info.description).replace("|", "\\|")
        rows.append(f"| `{name}` | {kind} | {_default(default)} | {limits(info)} | {meaning} |")
    return "\n".join(rows) + "\n"


def render(text: str, tables: dict[str, str]) -> str:
    """`text` with every marked table replaced by the generated one."""

    def replace(match: re.Match[str]) -> str:
        name = match["flow"]
        if name not in tables:
            raise KeyError(f"no flow named {name!r} has declared parameters")
        return match.group(1) + tables[name] + match.group(4)

    return BLOCK.sub(replace, text)


def documents() -> list[Path]:
    return [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def stale(write: bool) -> list[Path]:
    """The documents whose tables differ from the declaration (rewritten when `write`)."""
    tables = {name: table(flow) for name, flow in flows().items()}
    changed = []
    for path in documents():
        text = path.read_text()
        fresh = render(text, tables)
        if fresh != text:
            changed.append(path)
            if write:
                path.write_text(fresh)
    return changed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m flows.param_docs", description=__doc__)
    parser.add_argument("--check", action="store_true", help="report drift, change nothing")
    check = parser.parse_args(argv).check
    changed = stale(write=not check)
    for path in changed:
        verb = "differs from the declared parameters" if check else "rewritten"
        print(f"{path.relative_to(REPO)}: {verb}")
    if check and changed:
        print("run `python -m flows.param_docs` to regenerate", file=sys.stderr)
    return 1 if check and changed else 0


if __name__ == "__main__":
    sys.exit(main())
