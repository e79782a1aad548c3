"""A search's progress: trials running, completed, pruned and failed, the trial-epochs spent,
in the flow's log and in a Prefect progress artifact: the percent of the budget used, the
trials' or the trial-epochs', whichever is further along (the one that stops the asking).

The trial-epochs spent count every epoch trained: those of the finished trials (completed,
pruned, failed), those the running trials finished so far, and those of the trials a
resumed study kept (`spent_before`)."""

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
MAX_REPEATS_IN_A_ROW = 50


class SearchBoard:
    """Counts of one search, updated by its trial threads."""

    def __init__(
        self,
        n_trials: int,
        max_epochs: int,
        budget_epochs: int | None = None,
        spent_before: int = 0,
        key: str = PROGRESS_KEY,
    ):
        self.n_trials, self.max_epochs = n_trials, max_epochs
        self.budget_epochs, self.spent_before, self.key = budget_epochs, spent_before, key
        self.running = self.completed = self.pruned = self.failed = 0
        self.repeats = 0  # points asked again, told an earlier trial's result
        self.repeats_in_a_row = 0  # since the last trial that trained
        self.trial_epochs = 0  # this run's finished trials'
        self._live: dict[int, int] = {}  # running trial -> epochs it finished so far
        self._lock = threading.Lock()
        self._artifact: UUID | None = None

    def open(self) -> None:
        """The progress artifact at the budget used so far (0 %, or a resumed study's kept
        trial-epochs), in the caller's (the flow's) run context."""
        try:
            # _sync=True: Prefect's async_dispatch keyword for the synchronous variant.
            self._artifact = cast(
                UUID,
                create_progress_artifact(  # type: ignore[call-arg]
                    self._percent(), key=self.key, description=self.line(), _sync=True
                ),
            )
        except Exception as error:  # noqa: BLE001 - progress display is not the search
            log.warning("search progress artifact not created: %s", redact_text(str(error)))

    def started(self, number: int) -> None:
        with self._lock:
            self.running += 1
            self._live[number] = 0
            self.repeats_in_a_row = 0

    def epoch_done(self, number: int, epoch: int) -> None:
        """A running trial finished `epoch` (the referee judged it): it counts as spent."""
        with self._lock:
            if number in self._live:
                self._live[number] = max(self._live[number], epoch)

    def ended(self, number: int, outcome: TrialOutcome) -> str:
        """Count a finished trial; the progress line."""
        with self._lock:
            self.running -= 1
            self._live.pop(number, None)
            self.trial_epochs += len(outcome.history)
            if outcome.pruned_at is not None:
                self.pruned += 1
            elif outcome.completed:
                self.completed += 1
            else:
                self.failed += 1
            line, percent = self.line(), self._percent()
        self._push(percent, line)
        return line

    def repeated(self) -> str:
        """Count a trial told an earlier trial's result (no epochs); the progress line."""
        with self._lock:
            self.repeats += 1
            self.repeats_in_a_row += 1
            line, percent = self.line(), self._percent()
        self._push(percent, line)
        return line

    @property
    def done(self) -> int:
        return self.completed + self.pruned + self.failed + self.repeats

    @property
    def spent(self) -> int:
        """Trial-epochs spent: the kept trials', the finished ones', the running ones' so far."""
        with self._lock:
            return self._spent()

    def _spent(self) -> int:  # lock held
        return self.spent_before + self.trial_epochs + sum(self._live.values())

    def sampler_exhausted(self) -> bool:
        """The sampler asked only points already trained, MAX_REPEATS_IN_A_ROW times in a row:
        a discrete space it has covered, or one it has converged on. Asking on would only
        count repeats up to n_trials."""
        with self._lock:
            return self.repeats_in_a_row >= MAX_REPEATS_IN_A_ROW

    def _trained(self) -> int:
        return self.completed + self.pruned + self.failed

    def budget_reached(self) -> bool:
        return self.budget_epochs is not None and self.spent >= self.budget_epochs

    def _percent(self) -> float:
        # No trial left to ask (a resumed study that holds them all): nothing left to use.
        used = self.done / self.n_trials if self.n_trials > 0 else 1.0
        if self.budget_epochs is not None:
            used = max(used, self._spent() / self.budget_epochs)
        return 100.0 * min(1.0, used)

    def line(self) -> str:
        spent = self._spent()
        budget = (
            f" of a budget of {self.budget_epochs} ({100.0 * spent / self.budget_epochs:.0f} %)"
            if self.budget_epochs is not None
            else ""
        )
        return (
            f"search: {self.done}/{self.n_trials} trials done ({self.completed} completed, "
            f"{self.pruned} pruned, {self.failed} failed, {self.repeats} repeated points), "
            f"{self.running} running; {spent} trial-epochs spent{budget} (the trials trained, "
            f"each to {self.max_epochs} epochs as in a grid: {self._trained() * self.max_epochs})"
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
