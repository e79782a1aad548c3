"""Pet-name model with DDP: download -> format -> train (DDP) -> evaluate -> register.

Run it: `python -m flows.train_charlm --epochs 2` (or `make demo`).
"""

from __future__ import annotations

from ddpflow.charlm.corpus import DEFAULT_CORPUS_PATH
from ddpflow.config import Settings
from flows.charlm_pipeline import CharLMSummary, run_charlm_pipeline
from flows.cli import run_cli
from flows.params import CharLMParams, validate_params
from flows.redacted_flow import flow
from flows.runner import dask_task_runner


@flow(name="train-charlm", task_runner=dask_task_runner(), log_prints=True)
def train_charlm(
    source: str = str(DEFAULT_CORPUS_PATH),
    epochs: int = 3,
    batch_size: int = 512,
    lr: float = 0.005,
    hidden_size: int = 128,
    num_layers: int = 4,
    dropout: float = 0.1,
    world_size: int | None = None,
    seed: int = 0,
    holdout_fraction: float = 0.1,
    keep_last: int = 3,
    checkpoint_every_steps: int = 0,
    checkpoint_every_s: float = 600.0,
    num_names: int = 10,
    rank_timeout_s: float = 120.0,
    model_name: str = "ddpflow-charlm",
    experiment: str = "ddpflow-charlm",
    max_restarts: int = 2,
    min_workers: int | None = None,
    precision: str = "auto",
    pin_memory: str | bool = "auto",
    compile: bool = False,
) -> CharLMSummary:
    """Train the pet-name LSTM with one DDP rank per Dask worker and register the result."""
    params = validate_params(CharLMParams, dict(locals()))
    settings = Settings.from_env()
    summary, _, _ = run_charlm_pipeline(params, settings)
    print(summary.render(settings))
    return summary


if __name__ == "__main__":
    run_cli(train_charlm)
