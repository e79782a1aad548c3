"""The restarts of a DDP group as a Prefect markdown artifact (shared by the workloads)."""

from __future__ import annotations

from ddpflow.distributed.elastic import Restart
from ddpflow.tracking import RunRef


def restarts_markdown(run: RunRef, restarts: list[Restart]) -> str:
    rows = "\n".join(
        f"| {r.attempt} | {r.world_size or 'all'} | {', '.join(r.restarted_workers) or '-'} "
        f"| {r.heal_s:.1f} s | {r.cause.replace('|', '/')} |"
        for r in restarts
    )
    return (
        f"# DDP restarts of MLflow run `{run.run_id}`\n\n"
        "| restart | world size after | restarted (hung) workers | heal time | cause |\n"
        f"|---|---|---|---|---|\n{rows}\n"
    )
