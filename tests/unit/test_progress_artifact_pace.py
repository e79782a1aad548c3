"""The progress artifact's pace: at most one update per interval, but at once when an epoch
starts or its validation is done. No Prefect server: what the updater thread would send is
recorded instead of sent (its `_push`), the thread and its timing are the real ones."""

from __future__ import annotations

import time
import uuid

from ddpflow.distributed.progress import Progress
from ddpflow.integrations.prefect.progress_artifact import ProgressArtifact


def _step(step: int, epoch: int, val_loss: float | None = None) -> Progress:
    return Progress(
        step=step, total_steps=40, epoch=epoch, epochs=2, train_loss=1.0, val_loss=val_loss
    )


def _wait_for(pushed: list, count: int, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while len(pushed) < count and time.monotonic() < deadline:
        time.sleep(0.01)


def test_updates_wait_out_the_interval_but_not_an_epochs_start_or_end(monkeypatch) -> None:
    artifact = ProgressArtifact("pace", "test", min_interval_s=60)
    artifact.artifact_id = uuid.uuid4()
    pushed: list[str] = []
    monkeypatch.setattr(artifact, "_push", lambda percent, text: pushed.append(text))
    artifact._start_updater()
    artifact.update(_step(1, 1))
    _wait_for(pushed, 1)
    for step in range(2, 19):  # steps inside the epoch: held for the interval
        artifact.update(_step(step, 1))
    time.sleep(0.5)
    assert len(pushed) == 1, pushed
    artifact.update(_step(20, 1, val_loss=0.9))  # the epoch's validation is done
    _wait_for(pushed, 2)
    artifact.update(_step(21, 2))  # the next epoch starts
    _wait_for(pushed, 3)
    assert [text.split(", step ")[1].split("/")[0] for text in pushed] == ["1", "20", "21"]
    artifact.finish(succeeded=True)
    assert pushed[-1].startswith("test: done"), pushed
