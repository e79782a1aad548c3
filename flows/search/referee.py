"""A searched trial's referee in the flow process: each epoch's validation loss goes to the
study, and the study's verdict goes back to the trial's ranks.

The trial's rank 0 sends each epoch's loss as a progress event (fit's, at the epoch's end);
the launcher hands it to `Referee.subscriber` on the Dask client's event loop, which must
not block, so the referee's own thread takes it from there: `trial.report(loss, epoch)`,
`trial.should_prune()`, then the verdict as Dask Events the ranks wait for
(ddpflow.workloads.sweep.pruning). A trial the pruner stops ends at that epoch.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import optuna

from ddpflow.distributed.progress import Progress
from ddpflow.workloads.sweep.pruning import Verdicts, forget_verdicts, post_verdict
from flows.search.study import StudyDesk

log = logging.getLogger(__name__)


class Referee:
    """Judges one running trial, epoch by epoch; `pruned_at` is the epoch it was stopped at."""

    def __init__(
        self,
        desk: StudyDesk,
        trial: optuna.Trial,
        client: Any,
        verdicts: Verdicts,
        epochs: int,
        on_epoch: Callable[[int], None] | None = None,
    ):
        """`on_epoch(epoch)`: told of each epoch the trial finished (the search's budget)."""
        self.desk, self.trial, self.client = desk, trial, client
        self.verdicts, self.epochs, self.on_epoch = verdicts, epochs, on_epoch
        self.reported: dict[int, float] = {}
        self.pruned_at: int | None = None
        self._pool = ThreadPoolExecutor(1, thread_name_prefix=f"ddpflow-referee-{trial.number}")

    def subscriber(self, progress: Progress) -> None:
        """A launch's progress subscriber (on the client's event loop: hands off at once)."""
        if progress.val_loss is not None and progress.epoch is not None:
            self._pool.submit(self._judge, progress.epoch, progress.val_loss)

    def _judge(self, epoch: int, value: float) -> None:
        if epoch in self.reported:
            return  # delivered twice
        self.reported[epoch] = value
        if self.on_epoch is not None:
            self.on_epoch(epoch)
        can_prune = epoch < self.epochs  # the last epoch's ranks wait for nothing
        prune = self.pruned_at is not None  # stopped already: its ranks saw the verdict late
        try:
            if not prune:
                prune = self.desk.report(self.trial, epoch, value, can_prune)
        except Exception as error:  # noqa: BLE001 - the trial goes on unjudged
            log.warning(
                "trial %d: the study could not judge epoch %d: %s", self.trial.number, epoch, error
            )
        if prune and self.pruned_at is None:
            self.pruned_at = epoch
        if can_prune:
            try:
                post_verdict(self.client, self.verdicts, epoch, prune)
            except Exception as error:  # noqa: BLE001 - the ranks go on after their wait
                log.warning(
                    "trial %d: verdict on epoch %d not sent: %s", self.trial.number, epoch, error
                )

    def close(self) -> None:
        """After the trial's launch returned: judge what is queued, drop unread verdicts."""
        self._pool.shutdown(wait=True)
        try:
            forget_verdicts(self.client, self.verdicts, self.epochs)
        except Exception as error:  # noqa: BLE001 - a few bytes left on the scheduler
            log.info("trial %d: verdicts not cleared: %s", self.trial.number, error)
