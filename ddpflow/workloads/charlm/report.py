"""What the pet-name model's evaluation found, and how it is shown: markdown and JSON.

Torch-free: the evaluation task returns an EvalResult to the flow process, which unpickles it
by importing this module, and that process starts and stays without torch (seconds of CPU and
hundreds of MiB it has no use for; integration/test_flow_imports.py).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

from ddpflow import storage
from ddpflow.storage.redact import redact_url
from ddpflow.tracking.loggers import RunRef
from ddpflow.workloads.charlm.data import FormattedCorpus
from ddpflow.workloads.escape import markdown_text


@dataclass(frozen=True)
class EvalResult:
    val_loss: float
    names: list[str]
    novel_fraction: float
    checkpoint_uri: str
    epoch: int


def evaluation_markdown(run: RunRef, result: EvalResult, corpus: FormattedCorpus) -> str:
    names = "\n".join(f"- {markdown_text(n) if n else '(empty)'}" for n in result.names)
    return (
        f"# Pet-name model evaluation\n\n"
        f"| | |\n|---|---|\n"
        f"| MLflow run | `{run.run_id}` |\n"
        f"| epoch | {result.epoch} |\n"
        f"| holdout loss | {result.val_loss:.4f} |\n"
        f"| holdout names / samples | {corpus.num_val_names} / {corpus.num_val_samples} |\n"
        f"| generated names not in training set | {result.novel_fraction:.0%} |\n"
        f"| checkpoint | `{redact_url(result.checkpoint_uri)}` |\n\n"
        f"## Generated names\n\n{names}\n"
    )


def save_report(report_dir: str, result: EvalResult, markdown: str) -> list[str]:
    """The evaluation as markdown (for people) and JSON (for tools) in the artifact store."""
    md_uri = storage.join(report_dir, "evaluation.md")
    json_uri = storage.join(report_dir, "evaluation.json")
    storage.write_bytes(md_uri, markdown.encode())
    storage.write_bytes(json_uri, json.dumps(asdict(result), indent=2).encode())
    return [md_uri, json_uri]
