"""Champion/challenger: a new model takes the `champion` alias only if it scores better.

Both models are scored now, on the same fixed holdout (the split is a hash of each name, so
it does not move between runs), through the same registered-model path a consumer would use
(`models:/NAME/VERSION`). A loss recorded when the champion was trained is not reused: the
data may have changed since.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import mlflow
import torch
import torch.nn.functional as F
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient

from ddpflow.charlm.data import load_windows
from ddpflow.charlm.formatting import split_xy

CHAMPION_ALIAS = "champion"
TAG_PREFIX = "ddpflow.retrain."


@dataclass(frozen=True)
class Decision:
    promoted: bool
    reason: str
    challenger_version: str
    challenger_loss: float
    champion_version: str | None
    champion_loss: float | None
    margin: float

    def as_tags(self) -> dict[str, str]:
        return {f"{TAG_PREFIX}{k}": str(v) for k, v in asdict(self).items()}


def decide(challenger_loss: float, champion_loss: float | None, margin: float) -> tuple[bool, str]:
    """Promote when there is no champion, or the challenger's loss is lower by > margin."""
    if not math.isfinite(challenger_loss):
        return False, f"challenger loss {challenger_loss} is not a finite number"
    if champion_loss is None:
        return True, "no champion yet"
    if challenger_loss < champion_loss - margin:
        return True, (
            f"challenger {challenger_loss:.4f} beats champion {champion_loss:.4f} "
            f"by more than {margin:g}"
        )
    return False, (
        f"challenger {challenger_loss:.4f} does not beat champion "
        f"{champion_loss:.4f} by more than {margin:g}"
    )


def champion_version(tracking_uri: str, model_name: str) -> str | None:
    try:
        return (
            MlflowClient(tracking_uri)
            .get_model_version_by_alias(model_name, CHAMPION_ALIAS)
            .version
        )
    except MlflowException:  # no alias yet, or no registered model at all
        return None


@torch.no_grad()
def holdout_loss(tracking_uri: str, model_uri: str, val_uri: str, batch_size: int = 8192) -> float:
    """Mean per-symbol cross-entropy of a registered model on the holdout windows."""
    torch.set_num_threads(1)  # runs as a task on a 1-thread Dask worker
    mlflow.set_tracking_uri(tracking_uri)
    model = mlflow.pytorch.load_model(model_uri)
    x_all, y_all = split_xy(load_windows(val_uri))
    total, count = 0.0, 0
    for x, y in zip(x_all.split(batch_size), y_all.split(batch_size), strict=True):
        logits = model(x)
        total += F.cross_entropy(logits.transpose(1, 2), y, reduction="sum").item()
        count += y.numel()
    return total / count


def apply(tracking_uri: str, model_name: str, run_id: str, decision: Decision) -> None:
    """Record the decision on the challenger's run; move the alias only when promoted."""
    client = MlflowClient(tracking_uri)
    for key, value in decision.as_tags().items():
        client.set_tag(run_id, key, value)
    if decision.promoted:
        client.set_registered_model_alias(model_name, CHAMPION_ALIAS, decision.challenger_version)
