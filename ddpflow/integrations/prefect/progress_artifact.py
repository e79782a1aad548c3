"""A training's progress in Prefect: a progress artifact that follows rank 0's steps.

The artifact is a subscriber of the launches' one progress channel
(ddpflow.distributed.progress), beside the log-line callback: it takes the step counts of
the Progress events ddpflow.fit sends (percent of all steps, latest losses in its
description) and ignores the lines without them. It is created at 0 % when the training
task starts (so it belongs to that task run and its flow run), handed to every launch of
the training, restarts included, so one artifact shows the whole training, and set to
100 % when the training returned. The launcher delivers events on its Dask client's event
loop, where a blocking Prefect call must not run, so the updates go through a thread of
their own, newest first, at most one every `min_interval_s` (30 s) unless an epoch
starts or ends. Prefect being slow or down never slows or fails the training.
"""

from __future__ import annotations

import contextvars
import logging
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import cast
from uuid import UUID

from prefect.artifacts import create_progress_artifact, update_progress_artifact

from ddpflow.distributed.progress import Progress
from ddpflow.storage.redact import redact_text

log = logging.getLogger(__name__)
CLOSE_TIMEOUT_S = 15.0


class ProgressArtifact:
    """One Prefect progress artifact, updated from any thread without waiting."""

    # At most every 30 s, and at once when an epoch starts or its validation is done: each
    # update is a write on the Prefect server, which on a small machine shares the cores
    # with the ranks, and an event that `prefect deployment run --watch` prints; a person
    # reading either needs no finer grain.
    def __init__(self, key: str, title: str, min_interval_s: float = 30.0):
        self.key, self.title, self.min_interval_s = key, title, min_interval_s
        self.artifact_id: UUID | None = None
        self.latest: Progress | None = None
        # The group's latest world-size change, shown after the progress (note_size()).
        self.size_note = ""
        self._pending: Progress | None = None
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._milestone = threading.Event()  # an epoch began or ended: no waiting
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Create the artifact at 0 % (in the caller's Prefect run context) and the updater."""
        try:
            # _sync=True: Prefect's async_dispatch keyword (its typed signature lacks it) that
            # runs the synchronous variant, which returns the UUID.
            self.artifact_id = cast(
                UUID,
                create_progress_artifact(  # type: ignore[call-arg]
                    0.0, key=self.key, description=f"{self.title}: starting", _sync=True
                ),
            )
        except Exception as error:  # noqa: BLE001 - progress display is not the training
            log.warning("no progress artifact %s: %s", self.key, redact_text(str(error)))
            return
        self._start_updater()

    def _start_updater(self) -> None:
        context = contextvars.copy_context()  # the same Prefect settings and client
        self._thread = threading.Thread(
            target=context.run, args=(self._run,), name=f"progress-{self.key}", daemon=True
        )
        self._thread.start()

    def update(self, progress: Progress) -> None:
        """A progress subscriber: keep the newest step counts, wake the updater. A restart
        resumes at its checkpoint's step: the artifact stays put until it is passed."""
        if not progress.has_steps:
            return
        with self._lock:
            before = self.latest
            if before is None or progress.steps_done >= before.steps_done:
                self.latest = self._pending = progress
                if before is None or (progress.epoch, progress.val_loss is None) != (
                    before.epoch,
                    before.val_loss is None,
                ):
                    self._milestone.set()
        self._wake.set()

    def note_size(self, line: str) -> None:
        """Show `line` (a world-size change) after the progress from the next update on."""
        with self._lock:
            self.size_note = line
            self._pending = self._pending or self.latest
        self._wake.set()

    def finish(self, succeeded: bool) -> None:
        """100 % after a training that returned; else the last state, marked as failed."""
        if self._thread is None:
            return
        self._stop.set()
        self._wake.set()
        self._milestone.set()
        self._thread.join(CLOSE_TIMEOUT_S)
        latest = self.latest
        if succeeded:
            done = f"done, {latest.describe()}" if latest else "done"
            self._push(100.0, self._noted(f"{self.title}: {done}"))
        else:
            where = latest.describe() if latest else "before the first step"
            self._push(
                latest.percent if latest else 0.0, self._noted(f"{self.title}: failed at {where}")
            )

    def _noted(self, description: str) -> str:
        return f"{description}; {self.size_note}" if self.size_note else description

    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.wait()
            self._wake.clear()
            self._milestone.clear()  # before taking the update: a later milestone stays set
            with self._lock:
                progress, self._pending = self._pending, None
            if progress is not None and not self._stop.is_set():
                self._push(progress.percent, self._noted(f"{self.title}: {progress.describe()}"))
                self._milestone.wait(self.min_interval_s)

    def _push(self, percent: float, description: str) -> None:
        if self.artifact_id is None:
            return
        try:
            # _sync=True: as in start().
            update_progress_artifact(  # type: ignore[call-arg]
                self.artifact_id, percent, description, _sync=True
            )
        except Exception as error:  # noqa: BLE001 - progress display is not the training
            log.warning("progress artifact %s not updated: %s", self.key, redact_text(str(error)))


@contextmanager
def progress_artifact(key: str, title: str) -> Iterator[ProgressArtifact]:
    """The progress artifact `key` meanwhile: pass its `update` to the launches as a
    progress subscriber. It ends at 100 % if the block returns, else marked as failed."""
    artifact = ProgressArtifact(key, title)
    artifact.start()
    succeeded = False
    try:
        yield artifact
        succeeded = True
    finally:
        artifact.finish(succeeded)
