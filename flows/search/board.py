"""A search's progress: trials running, completed, pruned and failed, the trial-epochs spent,
in the flow's log and in a Prefect progress artifact (percent of the trials budget)."""

from __future__ import annotations

import logging
import threading
from typing import cast
from uuid import UUID

from prefect.artifacts import create_progress_artifact, update_progress_artifact

from ddpflow.storage.redact import redact_text
from ddpflow.workloads.sweep.execute import TrialOutcome

log = logging.getLogger(__name__)
PROGRESS_KEY = "charlm-search-progress"


class SearchBoard:
    """Counts of one search, updated by its trial threads."""

    def __init__(self, n_trials: int, max_epochs: int):
        self.n_trials, self.max_epochs = n_trials, max_epochs
        self.running = self.completed = self.pruned = self.failed = 0
        self.trial_epochs = 0
        self._lock = threading.Lock()
        self._artifact: UUID | None = None

    def open(self) -> None:
        """The progress artifact at 0 %, in the caller's (the flow's) run context."""
        try:
            # _sync=True: Prefect's async_dispatch keyword for the synchronous variant.
            self._artifact = cast(
                UUID,
                create_progress_artifact(  # type: ignore[call-arg]
                    0.0, key=PROGRESS_KEY, description=self.line(), _sync=True
                ),
            )
        except Exception as error:  # noqa: BLE001 - progress display is not the search
            log.warning("search progress artifact not created: %s", redact_text(str(error)))

    def started(self) -> None:
        with self._lock:
            self.running += 1

    def ended(self, outcome: TrialOutcome) -> str:
        """Count a finished trial; the progress line."""
        with self._lock:
            self.running -= 1
            self.trial_epochs += len(outcome.history)
            if outcome.pruned_at is not None:
                self.pruned += 1
            elif outcome.completed:
                self.completed += 1
            else:
                self.failed += 1
            line, percent = self.line(), 100.0 * self.done / self.n_trials
        self._push(percent, line)
        return line

    @property
    def done(self) -> int:
        return self.completed + self.pruned + self.failed

    def line(self) -> str:
        return (
            f"search: {self.done}/{self.n_trials} trials done ({self.completed} completed, "
            f"{self.pruned} pruned, {self.failed} failed), {self.running} running; "
            f"{self.trial_epochs} trial-epochs spent (a grid of the same trials: "
            f"{self.n_trials * self.max_epochs})"
        )

    def _push(self, percent: float, line: str) -> None:
        if self._artifact is None:
            return
        try:
            update_progress_artifact(  # type: ignore[call-arg]
                self._artifact, percent, line, _sync=True
            )
        except Exception as error:  # noqa: BLE001 - progress display is not the search
            log.warning("search progress artifact not updated: %s", redact_text(str(error)))
