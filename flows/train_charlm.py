"""Pet-name model with DDP: download -> format -> train (DDP) -> evaluate -> register.

Run it: `python -m flows.train_charlm --epochs 2` (or `make demo`).
"""

from __future__ import annotations

if __name__ == "__main__":
    # A command line: the embedded API and the cluster start while the imports below load.
    from ddpflow.integrations.prefect.early_api import start_services

    start_services()

from prefect import flow

from ddpflow.config import Settings
from ddpflow.integrations.prefect.task_runner import dask_task_runner
from flows.charlm_pipeline import CharLMSummary, run_charlm_pipeline
from flows.cli import run_cli
from flows.params import CharLMParams
from flows.summary import print_last


@flow(name="train-charlm", task_runner=dask_task_runner(), log_prints=True)  # type: ignore[arg-type]  # see dask_task_runner
def train_charlm(training: CharLMParams = CharLMParams()) -> CharLMSummary:  # noqa: B008 - frozen
    """Train the pet-name LSTM with one DDP rank per Dask worker and register the result."""
    settings = Settings.from_env()
    summary, _, _ = run_charlm_pipeline(training, settings)
    print_last(summary.render(settings))
    return summary


if __name__ == "__main__":
    run_cli(train_charlm)
