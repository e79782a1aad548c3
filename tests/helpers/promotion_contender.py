"""One promoter process of tests/integration/test_promotion_limit.py: rounds of holding a
model's promotion limit (`promotion_lock`, the flows' own) on the Prefect server in
PREFECT_API_URL, each a promotion's locked part reduced to its timing.

    python -m tests.helpers.promotion_contender MODEL ROUNDS EVENTS GO WORK_S

It writes "ready" once imported, waits for the file GO, then per round: takes the limit,
"decides" for WORK_S (where the test freezes it), checks its lease (`ensure_held`, as the
promotion does right before the alias write) and "writes" for WRITE_S, or records that the
lock was lost. Events are JSON lines with CLOCK_MONOTONIC times, which every process of the
machine shares.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from ddpflow.integrations.prefect.promotion_limit import promotion_lock
from ddpflow.registry.promotion_lock import PromotionLockLost

WRITE_S = 0.1
POLL_S = 0.5  # the flows' 2 s would only make the test longer
# Unused: with a shared Prefect server the registry is not consulted.
REGISTRY = "http://mlflow.invalid"


def main(model: str, rounds: int, events_path: Path, go: Path, work_s: float) -> None:
    with events_path.open("a", buffering=1) as events:

        def emit(event: str, round_: int = -1) -> None:
            line = {"pid": os.getpid(), "round": round_, "event": event, "t": time.monotonic()}
            events.write(json.dumps(line) + "\n")

        emit("ready")
        while not go.exists():
            time.sleep(0.05)
        for round_ in range(rounds):
            with promotion_lock(REGISTRY, model, poll_s=POLL_S) as held:
                emit("acquired", round_)
                time.sleep(work_s)
                try:
                    held.ensure_held()
                except PromotionLockLost:
                    emit("lost", round_)
                    continue
                emit("writing", round_)
                time.sleep(WRITE_S)
                emit("written", round_)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), Path(sys.argv[3]), Path(sys.argv[4]), float(sys.argv[5]))
