"""Scheduled retraining: train a challenger, promote it only if it beats the champion.

The challenger goes through the same pipeline as `train-charlm` (one MLflow run, one DDP
training, a registered version). Then both the challenger and the model holding the
`champion` alias are scored on the same fixed holdout, and the alias moves only if the
challenger's loss is lower by more than `margin`. A failed challenger stops the flow before
the decision, so it never touches the alias, and so does a registry that cannot say who the
champion is. The deployment runs one retrain at a time (concurrency limit 1, later runs
queue); a retrain or sweep started elsewhere meanwhile is serialised with it by the model's
promotion lock in the registry (`ddpflow.promotion_lock`).
"""

from __future__ import annotations

from ddpflow.charlm.champion import Decision
from ddpflow.charlm.corpus import DEFAULT_CORPUS_PATH
from ddpflow.config import Settings
from flows.charlm_pipeline import run_charlm_pipeline
from flows.cli import run_cli
from flows.params import CharLMParams, ParameterError, validate_params
from flows.redacted_flow import flow
from flows.runner import dask_task_runner
from tasks.retrain import score_and_promote


@flow(name="retrain-charlm", task_runner=dask_task_runner(), log_prints=True)
def retrain_charlm(
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
    margin: float = 0.0,
    precision: str = "auto",
    pin_memory: str | bool = "auto",
    compile: bool = False,
) -> Decision:
    """Train a challenger and promote it to `champion` only if it is better by `margin`."""
    values = dict(locals())
    if not margin >= 0:
        raise ParameterError(f"invalid flow parameters: margin={margin!r}: must be >= 0")
    params = validate_params(CharLMParams, {k: v for k, v in values.items() if k != "margin"})
    settings = Settings.from_env()
    summary, run, corpus = run_charlm_pipeline(
        params, settings, tags={"ddpflow.role": "challenger"}
    )
    decision = score_and_promote.submit(
        run, params.model_name, summary.model_version, corpus.val_uri, margin
    ).result()
    print(summary.render(settings))
    print(
        f"retraining decision: {'PROMOTED' if decision.promoted else 'kept champion'} "
        f"({decision.reason})"
    )
    return decision


if __name__ == "__main__":
    run_cli(retrain_charlm)
