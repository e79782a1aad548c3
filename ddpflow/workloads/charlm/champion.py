"""Champion/challenger: a new model takes the `champion` alias only if it scores better.

Both models are scored now, on the same fixed holdout (the split is a hash of each name, so
it does not move between runs). A loss recorded when the champion was trained is not reused:
the data may have changed since. Each version is scored from the ddpflow checkpoint it was
registered from, rebuilt with ddpflow's own model class; nothing from the registry is ever
imported or unpickled (see `ddpflow.registry.read`).

Every promotion (a deployment's retrain, a retrain or sweep started from a shell) goes through
`promote`, which sets the alias only while holding the model's promotion lock and only after
re-reading the alias under it: two promotions that overlap are decided one after the other,
the second against whatever the first left as champion.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from mlflow.tracking import MlflowClient

from ddpflow.registry.promotion_lock import promotion_lock
from ddpflow.registry.read import CHAMPION_ALIAS, RegistryError, alias_version, version_checkpoint
from ddpflow.storage.redact import clean_cause, error_text, redact_url
from ddpflow.tracking.inspection import record_decision_on_versions
from ddpflow.workloads.charlm.data import load_windows
from ddpflow.workloads.charlm.decision import Decision, decide
from ddpflow.workloads.charlm.evaluation import load_model
from ddpflow.workloads.charlm.formatting import split_xy

__all__ = ["CHAMPION_ALIAS", "Decision", "decide", "promote", "score_version"]


def champion_version(tracking_uri: str, model_name: str) -> str | None:
    """The champion's version; None only when there is none (a registry error raises)."""
    return alias_version(MlflowClient(tracking_uri), model_name, CHAMPION_ALIAS)


def score_version(client: MlflowClient, model_name: str, version: str, val_uri: str) -> float:
    """Holdout loss of a registered version, from its weights-only ddpflow checkpoint."""
    uri = version_checkpoint(client, model_name, version)
    try:
        model, _ = load_model(uri)
    except Exception as error:  # missing file, not weights-only, not a CharLSTM state
        raise RegistryError(
            f"registered model {model_name!r} version {version}: cannot load its ddpflow "
            f"checkpoint {redact_url(uri)} as plain weights ({error_text(error)}); it is "
            "never loaded any other way"
        ) from clean_cause(error)
    return holdout_loss(model, val_uri)


@torch.no_grad()
def holdout_loss(model: torch.nn.Module, val_uri: str, batch_size: int = 8192) -> float:
    """Mean per-symbol cross-entropy of a pet-name model on the holdout windows."""
    torch.set_num_threads(1)  # runs as a task on a 1-thread Dask worker
    x_all, y_all = split_xy(load_windows(val_uri))
    total, count = 0.0, 0
    for x, y in zip(x_all.split(batch_size), y_all.split(batch_size), strict=True):
        logits, _ = model(x)
        total += F.cross_entropy(logits.transpose(1, 2), y, reduction="sum").item()
        count += y.numel()
    return total / count


def promote(
    tracking_uri: str,
    model_name: str,
    run_id: str,
    challenger_version: str,
    val_uri: str,
    margin: float,
) -> Decision:
    """Score challenger and champion; move `champion` only if the challenger is better.

    The slow scoring happens before the lock; under it the alias is read again, and a
    champion that changed meanwhile is scored before deciding.
    """
    client = MlflowClient(tracking_uri)
    scores: dict[str, float] = {}

    def score(version: str) -> float:
        if version not in scores:
            scores[version] = score_version(client, model_name, version, val_uri)
        return scores[version]

    seen = alias_version(client, model_name)
    if seen is not None:
        score(seen)
    challenger_loss = score(challenger_version)
    with promotion_lock(client, model_name):
        champion = alias_version(client, model_name)
        champion_loss = None if champion is None else score(champion)
        promoted, reason = decide(challenger_loss, champion_loss, margin)
        decision = Decision(
            promoted, reason, challenger_version, challenger_loss, champion, champion_loss, margin
        )
        apply(client, model_name, run_id, decision)
    return decision


def apply(client: MlflowClient, model_name: str, run_id: str, decision: Decision) -> None:
    """Record the decision on the challenger's run and on both versions involved; move the
    alias only when promoted."""
    for key, value in decision.as_tags().items():
        client.set_tag(run_id, key, value)
    record_decision_on_versions(
        client,
        model_name,
        decision.as_tags(),
        decision.challenger_version,
        decision.champion_version,
    )
    if decision.promoted:
        client.set_registered_model_alias(model_name, CHAMPION_ALIAS, decision.challenger_version)
