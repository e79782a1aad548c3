"""Champion/challenger: a new model takes the `champion` alias only if it scores better.

Both models are scored now, on the same fixed holdout (the split is a hash of each name, so
it does not move between runs). A loss recorded when the champion was trained is not reused:
the data may have changed since. Each version is scored from the ddpflow checkpoint it was
registered from, rebuilt with ddpflow's own model class; nothing from the registry is ever
imported or unpickled (see `ddpflow.registry.read`).

Every promotion (a deployment's retrain, a retrain or sweep started from a shell) goes through
`promote`, which decides and sets the alias only while holding the model's promotion lock
(`lock`: the flows pass Prefect's, `ddpflow.integrations.prefect.promotion_limit`): two
promotions that overlap are decided one after the other, the second against whatever the
first left as champion. Right before setting the alias it reads it once more and checks that
its lock is still held; if the champion moved since the decision, or the lock may be lost,
nothing moves and the decision's reason says "promotion aborted" (on the run, the versions
and the flow's decision artifact).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import torch
import torch.nn.functional as F
from mlflow.entities import RunTag
from mlflow.tracking import MlflowClient

from ddpflow.registry.promotion_lock import HeldLock, PromotionLock, PromotionLockLost, unlocked
from ddpflow.registry.read import CHAMPION_ALIAS, RegistryError, alias_version, version_checkpoint
from ddpflow.storage.redact import clean_cause, error_text, redact_url
from ddpflow.tracking.inspection import record_decision_on_versions
from ddpflow.workloads.charlm.data import open_windows
from ddpflow.workloads.charlm.decision import Decision, decide
from ddpflow.workloads.charlm.evaluation import load_model

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
    val = open_windows(val_uri)  # in memory, or streamed shard by shard
    total, count = 0.0, 0
    for index in torch.arange(len(val)).split(batch_size):
        x, y = val.batch(index)
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
    lock: PromotionLock = unlocked,
) -> Decision:
    """Score challenger and champion; move `champion` only if the challenger is better.

    The slow scoring happens before the lock; under it the alias is read again, and a
    champion that changed meanwhile is scored before deciding. `lock` serialises promotions
    of the model (the flows pass Prefect's); the default takes none, for a lone promoter.
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
    with lock(tracking_uri, model_name) as held:
        decision = decide_under_lock(
            client, model_name, challenger_version, challenger_loss, score, margin, held
        )
        record(client, model_name, run_id, decision, held)
    return decision


def decide_under_lock(
    client: MlflowClient,
    model_name: str,
    challenger_version: str,
    challenger_loss: float,
    score: Callable[[str], float],
    margin: float,
    lock: HeldLock,
) -> Decision:
    """Decide against the champion as it is now, and move the alias if the challenger wins."""
    champion = alias_version(client, model_name)
    champion_loss = None if champion is None else score(champion)
    promoted, reason = decide(challenger_loss, champion_loss, margin)
    decision = Decision(
        promoted, reason, challenger_version, challenger_loss, champion, champion_loss, margin
    )
    if decision.promoted:
        decision = set_alias_if_unchanged(client, model_name, decision, lock)
    return decision


def set_alias_if_unchanged(
    client: MlflowClient, model_name: str, decision: Decision, lock: HeldLock
) -> Decision:
    """Move the alias to the challenger, unless the champion the decision was made against
    is no longer the champion, or the lock may no longer be ours: then nothing moves and the
    decision says why."""
    # Read again right before the write: only a hand-made move (UI, API), a holder that
    # outlived its lease or one without a lock could have changed it; this decision is stale.
    now = alias_version(client, model_name)
    if now != decision.champion_version:
        return replace(
            decision,
            promoted=False,
            reason=(
                f"promotion aborted: the champion changed from {_version(decision)} to "
                f"{'none' if now is None else 'v' + now} while this promotion decided "
                f"({decision.reason}); the alias was left alone, retry to decide against "
                "the new champion"
            ),
        )
    try:
        lock.ensure_held()  # the last step before the write: nothing slow after it
    except PromotionLockLost as error:
        return replace(
            decision,
            promoted=False,
            reason=f"promotion aborted: {error}; the alias was left alone, retry to decide again",
        )
    client.set_registered_model_alias(model_name, CHAMPION_ALIAS, decision.challenger_version)
    return decision


def _version(decision: Decision) -> str:
    return "none" if decision.champion_version is None else f"v{decision.champion_version}"


def record(
    client: MlflowClient, model_name: str, run_id: str, decision: Decision, lock: HeldLock
) -> None:
    """Record the decision on the challenger's run and on both versions involved.

    The champion's version is written only while the lock is still ours: another promoter
    may be writing its own decision on that version, and MLflow's tag upsert (read, then
    insert) fails one of two concurrent writers. The challenger's run and version are this
    promotion's own.
    """
    tags = decision.as_tags()
    client.log_batch(run_id, tags=[RunTag(key, value) for key, value in tags.items()])
    try:
        lock.ensure_held()
        champion = decision.champion_version
    except PromotionLockLost:
        champion = None
    record_decision_on_versions(client, model_name, tags, decision.challenger_version, champion)
