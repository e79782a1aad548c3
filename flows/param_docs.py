"""`--help` and the docs' tables, from Prefect's schema of each flow (its deployment form).
`python -m flows.param_docs` rewrites each `<!-- parameters: FLOW -->` table in README.md and
docs/*.md up to `<!-- end parameters -->`; with `--check` it only lists those that differ."""

import importlib
import json
import re
import sys
from pathlib import Path

from prefect import Flow

REPO = Path(__file__).resolve().parents[1]
BLOCK = re.compile(r"(<!-- parameters: ([a-z-]+) -->\n).*?(<!-- end parameters -->)", re.DOTALL)
BOUNDS = {"minimum": ">=", "exclusiveMinimum": ">", "maximum": "<=", "exclusiveMaximum": "<"}
FLOWS = (
    "train_charlm retrain_charlm sweep_charlm train_images sweep_images scaling_charlm "
    "scaling_images"
)


def flows() -> dict[str, Flow]:
    found = [getattr(importlib.import_module(f"flows.{n}"), n) for n in FLOWS.split()]
    return {flow.name: flow for flow in found}


def parameter(flow: Flow) -> tuple[str, str, dict[str, dict]]:  # name, model, fields' schema
    schema = flow.parameters.model_dump_for_openapi()
    [name], [(model, spec)] = schema["properties"], schema["definitions"].items()
    return name, model, spec["properties"]


def limits(field: dict) -> str:
    """A field's bounds or choices as text: "1 to 64", "> 0, <= 10", "adam, sgd"."""
    members = field.get("anyOf", [field])
    named = [str(v) for m in members for v in m.get("enum", [m["const"]] if "const" in m else [])]
    named += ["true", "false"] if named and {"type": "boolean"} in members else []
    found = {k: str(m[k]).removesuffix(".0") for m in members for k in BOUNDS if k in m}
    if found.keys() == {"minimum", "maximum"}:
        return f"{found['minimum']} to {found['maximum']}"
    text = ", ".join(named or [f"{BOUNDS[k]} {v}" for k, v in found.items()])
    return text or ("not empty" if any("minLength" in m for m in members) else "")


def field_help(field: dict) -> str:
    return f"{field['description']} [{limits(field)}]" if limits(field) else field["description"]


def table(flow: Flow) -> str:
    name, model, fields = parameter(flow)
    rows = [f"Fields of the flow's parameter `{name}` (`{model}`):", ""]
    rows += ["| field | type | default | allowed | meaning |", "|---|---|---|---|---|"]
    for key, field in fields.items():
        kind = " or ".join(m["type"] for m in field.get("anyOf", [field])).replace("null", "unset")
        value = field["default"]  # JSON, the shipped data's path relative to the clone
        shown = value.removeprefix(f"{REPO}/") if isinstance(value, str) else json.dumps(value)
        shown = "unset" if value is None else f"`{shown}`"
        meaning = field["description"].replace("|", "\\|")
        rows.append(f"| `{key}` | {kind} | {shown} | {limits(field)} | {meaning} |")
    return "\n".join(rows) + "\n"


def render(text: str, tables: dict[str, str]) -> str:  # KeyError: a table of no such flow
    return BLOCK.sub(lambda match: match[1] + tables[match[2]] + match[3], text)


def stale(write: bool) -> list[Path]:
    """The documents whose tables differ from the declaration (rewritten when `write`)."""
    tables = {name: table(flow) for name, flow in flows().items()}
    texts = {p: p.read_text() for p in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]}
    changed = {p: fresh for p, text in texts.items() if (fresh := render(text, tables)) != text}
    for path, fresh in changed.items() if write else ():
        path.write_text(fresh)
    return list(changed)


if __name__ == "__main__":
    if (check := sys.argv[1:]) not in ([], ["--check"]):
        sys.exit(f"usage: python -m flows.param_docs [--check]\n\n{__doc__}")
    for path in (changed := stale(write=not check)):
        print(f"{path.relative_to(REPO)}: {'differs' if check else 'rewritten'}")
    sys.exit("run `python -m flows.param_docs` to regenerate" if check and changed else 0)
