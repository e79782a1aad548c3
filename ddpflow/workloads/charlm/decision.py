"""The champion/challenger decision and its rule, free of torch: the retraining flow's
process returns it and starts without torch (ddpflow.workloads.charlm.champion scores the
models)."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

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
    """Promote when there is no champion, when its loss is not finite (NaN, inf), or when the
    challenger's loss is lower by more than margin."""
    if not math.isfinite(challenger_loss):
        return False, f"challenger loss {challenger_loss} is not a finite number"
    if champion_loss is None:
        return True, "no champion yet"
    if not math.isfinite(champion_loss):
        # NaN compares false with everything: a NaN champion would otherwise keep the alias
        # against every challenger, forever.
        return True, (
            f"champion loss {champion_loss} is not a finite number: any challenger with a "
            f"finite loss ({challenger_loss:.4f}) is better"
        )
    if challenger_loss < champion_loss - margin:
        return True, (
            f"challenger {challenger_loss:.4f} beats champion {champion_loss:.4f} "
            f"by more than {margin:g}"
        )
    return False, (
        f"challenger {challenger_loss:.4f} does not beat champion "
        f"{champion_loss:.4f} by more than {margin:g}"
    )
