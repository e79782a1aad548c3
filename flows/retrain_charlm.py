"""Scheduled retraining: train a challenger, promote it only if it beats the champion.

The challenger goes through the same pipeline as `train-charlm` (one MLflow run, one DDP
training, a registered version). Then both the challenger and the model holding the
`champion` alias are scored on the same fixed holdout, and the alias moves only if the
challenger's loss is lower by more than `margin`. A failed challenger stops the flow before
the decision, so it never touches the alias, and so does a registry that cannot say who the
champion is. The deployment runs one retrain at a time (concurrency limit 1, later runs
queue); a retrain or sweep started elsewhere meanwhile is serialised with it by the model's
promotion lock, a Prefect concurrency limit on the shared Prefect server
(`ddpflow.integrations.prefect.promotion_limit`).
"""

from __future__ import annotations

if __name__ == "__main__":
    # A command line: the embedded API and the cluster start while the imports below load.
    from ddpflow.integrations.prefect.early_api import start_services

    start_services()

from prefect import flow

from ddpflow.config import Settings
from ddpflow.integrations.prefect.task_runner import dask_task_runner
from ddpflow.workloads.charlm.decision import Decision
from flows.charlm_pipeline import run_charlm_pipeline
from flows.cli import run_cli
from flows.params import RetrainParams
from flows.summary import print_last
from tasks.retrain import score_and_promote


@flow(name="retrain-charlm", task_runner=dask_task_runner(), log_prints=True)  # type: ignore[arg-type]  # see dask_task_runner
def retrain_charlm(training: RetrainParams = RetrainParams()) -> Decision:  # noqa: B008 - frozen
    """Train a challenger and promote it to `champion` only if it is better by `margin`."""
    margin = training.margin
    settings = Settings.from_env()
    summary, run, corpus = run_charlm_pipeline(
        training, settings, tags={"ddpflow.role": "challenger"}
    )
    decision = score_and_promote.submit(
        run, training.model_name, summary.model_version, corpus.val_uri, margin
    ).result()
    verdict = "PROMOTED" if decision.promoted else "kept champion"
    print_last(
        f"{summary.render(settings).rstrip()}\nretraining decision: {verdict} ({decision.reason})"
    )
    return decision


if __name__ == "__main__":
    run_cli(retrain_charlm)
