"""The champion/challenger step of the retraining flow."""

from __future__ import annotations

from prefect import task
from prefect.artifacts import create_markdown_artifact

from ddpflow.integrations.prefect.promotion_limit import promotion_lock
from ddpflow.tracking.loggers import RunRef
from ddpflow.workloads.charlm.decision import Decision


@task(name="score-and-promote")
def score_and_promote(
    run: RunRef, model_name: str, challenger_version: str, val_uri: str, margin: float
) -> Decision:
    """Score challenger and champion on the same holdout; move `champion` only if better.

    The one promotion path of every flow (retrain, sweep): promotions of a model are
    serialised by its Prefect concurrency limit, whoever started them (`promotion_limit`:
    without a shared Prefect server, a shared registry refuses to promote).
    """
    from ddpflow.workloads.charlm.champion import promote  # needs torch: imported where it runs

    decision = promote(
        run.tracking_uri, model_name, run.run_id, challenger_version, val_uri, margin,
        lock=promotion_lock,
    )  # fmt: skip
    create_markdown_artifact(
        markdown=decision_markdown(model_name, run, decision),
        key="charlm-retrain-decision",
        description="champion/challenger decision",
    )
    return decision


def decision_markdown(model_name: str, run: RunRef, decision: Decision) -> str:
    champion = (
        f"v{decision.champion_version}: {decision.champion_loss:.4f}"
        if decision.champion_version
        else "none"
    )
    verdict = "**promoted**" if decision.promoted else "**kept the champion**"
    return (
        f"# Retraining decision for `{model_name}`: {verdict}\n\n"
        f"| | |\n|---|---|\n"
        f"| challenger | v{decision.challenger_version}: {decision.challenger_loss:.4f} |\n"
        f"| champion before | {champion} |\n"
        f"| margin | {decision.margin:g} |\n"
        f"| reason | {decision.reason} |\n"
        f"| challenger MLflow run | `{run.run_id}` |\n\n"
        "Scores are the mean per-character loss of each registered version's checkpoint on "
        "the same fixed holdout (lower is better).\n"
    )
