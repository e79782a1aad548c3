"""How the flows' parameters are shown: `--help` and the docs' parameter tables.

Both come from the flow's parameter model (flows.params). `python -m flows.param_docs`
rewrites every table between the markers

    <!-- parameters: train-charlm -->
    <!-- end parameters -->

in README.md and docs/*.md; `--check` only reports the files whose tables differ and exits 1.
tests/integration/test_param_declaration.py runs the check, so a table never drifts from the
code.
"""

from __future__ import annotations

import argparse
import re
import sys
import typing
from pathlib import Path
from typing import Any, Literal

from prefect import Flow
from pydantic import BaseModel
from pydantic.fields import FieldInfo

from ddpflow.param_types import limits, union_members

REPO = Path(__file__).resolve().parents[1]
BLOCK = re.compile(
    r"(<!-- parameters: (?P<flow>[a-z-]+) -->\n)(?P<table>.*?)(<!-- end parameters -->)",
    re.DOTALL,
)


def flows() -> dict[str, Flow]:
    """Every flow with a parameter model, by flow name."""
    from flows.retrain_charlm import retrain_charlm
    from flows.scaling_charlm import scaling_charlm
    from flows.scaling_images import scaling_images
    from flows.sweep_charlm import sweep_charlm
    from flows.train_charlm import train_charlm
    from flows.train_images import train_images

    found = [train_charlm, retrain_charlm, sweep_charlm, train_images]
    return {f.name: f for f in [*found, scaling_charlm, scaling_images]}


def parameter_model(flow: Flow) -> tuple[str, type[BaseModel]]:
    """The flow's one parameter: its name and its model."""
    hints = typing.get_type_hints(flow.fn)
    [(name, model)] = [(k, v) for k, v in hints.items() if k != "return"]
    return name, model


def field_help(info: FieldInfo) -> str:
    """The field's description, with its limits ("1 to 64") after it."""
    shown = limits(info)
    return f"{info.description} [{shown}]" if shown else str(info.description)


def type_name(annotation: Any) -> str:
    """ "int", "float or unset", "JSON object": what a user passes."""
    names = []
    for member in union_members(annotation):
        if member is type(None):
            names.append("unset")
        elif typing.get_origin(member) is Literal:
            names.append(type(typing.get_args(member)[0]).__name__)
        elif typing.get_origin(member) in (dict, list):
            names.append("JSON " + ("object" if typing.get_origin(member) is dict else "list"))
        else:
            names.append(member.__name__)
    return " or ".join(dict.fromkeys(names))


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


def table(flow: Flow) -> str:
    """The fields of the flow's parameter model as a markdown table, one row each."""
    name, model = parameter_model(flow)
    rows = [
        f"Fields of the flow's parameter `{name}` (`{model.__name__}`):",
        "",
        "| field | type | default | allowed | meaning |",
        "|---|---|---|---|---|",
    ]
    for field, info in model.model_fields.items():
        kind, default = type_name(info.annotation), _default(info.default)
        meaning = str(info.description).replace("|", "\\|")
        rows.append(f"| `{field}` | {kind} | {default} | {limits(info)} | {meaning} |")
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
