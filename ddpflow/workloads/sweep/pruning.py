"""How a searched trial is stopped at a rung: its ranks wait, at each epoch's end, for the
flow's verdict on that epoch.

The trial's rank 0 already sends each epoch's validation loss to the flow process
(fit's progress event at the epoch's end: ddpflow.distributed.progress). There the study
decides (report, should_prune) and posts its verdict as Dask Events (`post_verdict`): the
trial's `stop` event if it prunes, then in any case the epoch's `judged` event. At the same
epoch end, after fit has logged the epoch's metrics and before its checkpoint, rank 0 waits
for `judged` (up to `Verdicts.wait_s`; no answer in time: it goes on) and reads `stop`, all
ranks agree on it with one all-reduce, and a pruned trial stops there: its ranks return the
epochs trained, and its workers are free for the next trial. A pruned trial therefore trains
exactly up to its rung, never into the next epoch, at the cost of one round trip to the flow
per epoch (tens of milliseconds). A stop that comes after the wait is taken at the next
epoch's end. The last epoch waits for nothing: there is nothing left to save.

The process-wide graceful stop (ddpflow.distributed.supervisor.graceful_stop) is not used:
its request belongs to the worker process and the launcher relaunches a group it stopped;
a pruned trial is neither a leaving worker nor a failure, and must end before its next
epoch starts, which a request polled at control steps cannot promise.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from mlflow.entities import Metric
from mlflow.tracking import MlflowClient

from ddpflow.training.result import EpochStats, TrainResult
from ddpflow.workloads.sweep.trial import (
    ELAPSED_METRIC,
    FINAL_VAL_LOSS_METRIC,
    TrialJob,
    elapsed_by_epoch,
    train_rank_of,
)

if TYPE_CHECKING:
    from ddpflow.training.context import TrainContext

VERDICT_PREFIX = "ddpflow-verdict"
DEFAULT_WAIT_S = 30.0


@dataclass(frozen=True)
class Verdicts:
    """Where a trial's ranks find the flow's verdicts: `key` is the trial's own (unique per
    launch), `wait_s` how long rank 0 waits for one before going on."""

    key: str
    wait_s: float = DEFAULT_WAIT_S

    def judged(self, epoch: int) -> str:
        """The event set once the study judged `epoch`."""
        return f"{VERDICT_PREFIX}-{self.key}-judged-{epoch}"

    @property
    def stop(self) -> str:
        """The event set once the study pruned the trial (it stays set)."""
        return f"{VERDICT_PREFIX}-{self.key}-stop"


class TrialPruned(Exception):
    """Raised on every rank at the epoch end where the study pruned the trial."""

    def __init__(self, epoch: int):
        super().__init__(epoch)
        self.epoch = epoch


def post_verdict(client: Any, verdicts: Verdicts, epoch: int, prune: bool) -> None:
    """In the flow process: the study's verdict on `epoch` for the trial's ranks (the stop
    first, so that a rank that sees the epoch judged sees the stop too)."""
    import distributed

    if prune:
        distributed.Event(verdicts.stop, client=client).set()
    distributed.Event(verdicts.judged(epoch), client=client).set()


def forget_verdicts(client: Any, verdicts: Verdicts, epochs: int) -> None:
    """In the flow process, once the trial ended: drop its events from the scheduler."""
    import distributed

    for name in (verdicts.stop, *(verdicts.judged(e) for e in range(1, epochs + 1))):
        distributed.Event(name, client=client).clear()  # unset and unwaited: deleted


def search_trial_rank(ctx: TrainContext, job: TrialJob, verdicts: Verdicts) -> TrainResult:
    """One rank of a searched trial: its workload's training, stopped at an epoch's end if
    the flow prunes it there; rank 0 logs elapsed seconds (and the final loss, if it
    completed)."""
    train_rank = train_rank_of(job)
    seen: list[EpochStats] = []

    def at_epoch_end(stats: EpochStats) -> None:
        seen.append(stats)
        if stats.epoch < job.epochs and _agree(ctx, _verdict(ctx, verdicts, stats.epoch)):
            raise TrialPruned(stats.epoch)

    try:
        result = train_rank(ctx, job, on_epoch_end=at_epoch_end)
    except TrialPruned as pruned:
        result = TrainResult(rank=ctx.rank, history=list(seen), latest_checkpoint=None)
        if ctx.is_main:
            ctx.report(f"pruned by the study after epoch {pruned.epoch}/{job.epochs}")
            _log_metrics(job, result.history, final=False)
        return result
    if ctx.is_main:
        _log_metrics(job, result.history, final=True)
    return result


def _verdict(ctx: TrainContext, verdicts: Verdicts, epoch: int) -> bool:
    """Rank 0: whether the study stopped the trial, once it judged `epoch` or after wait_s
    (the other ranks: False, and rank 0's answer through _agree)."""
    if not ctx.is_main or verdicts.wait_s <= 0:  # wait_s 0: no pruner, nothing to wait for
        return False
    import distributed

    client = distributed.get_client()
    started = time.monotonic()
    judged = distributed.Event(verdicts.judged(epoch), client=client).wait(verdicts.wait_s)
    ctx.heartbeat()  # the wait is not a stall
    waited = time.monotonic() - started
    if not judged and _abandoned():
        ctx.report(f"no verdict on epoch {epoch}: the flow that launched the trial is gone")
        return True  # stop: nobody will read the result, and the workers are wanted
    if not judged:
        ctx.report(f"no verdict on epoch {epoch} within {verdicts.wait_s:g} s; going on")
    elif waited > 1.0:
        ctx.report(f"the verdict on epoch {epoch} took {waited:.1f} s")
    # A stop the study posted late (after the wait) still counts at the next epoch's end.
    return bool(distributed.Event(verdicts.stop, client=client).is_set())


def _abandoned() -> bool:
    """Whether Dask cancelled this rank's task: its flow process (the client that launched
    it) is gone, killed say, and a rerun may want these workers for the study's next trial."""
    try:
        import distributed

        worker = distributed.get_worker()
        task = worker.state.tasks.get(worker.get_current_task())
    except (ValueError, AttributeError, KeyError):  # not in a worker's task thread
        return False
    return task is not None and task.state == "cancelled"


def _agree(ctx: TrainContext, prune: bool) -> bool:
    """Rank 0's verdict on every rank (one all-reduce; a group of one has nothing to do)."""
    if ctx.world_size == 1:
        return prune
    import torch

    from ddpflow.training.validation import all_reduce_sum

    flag = torch.tensor([1.0 if prune else 0.0], dtype=torch.float32)
    all_reduce_sum(flag, ctx.rank_context)
    return bool(flag[0] > 0)


def _log_metrics(job: TrialJob, history: Sequence[EpochStats], final: bool) -> None:
    """Elapsed training seconds per epoch; the final loss of a trial that completed."""
    now_ms = int(time.time() * 1000)
    metrics = [Metric(ELAPSED_METRIC, s, now_ms, epoch) for epoch, s in elapsed_by_epoch(history)]
    if final and history:
        last = history[-1]
        metrics.append(Metric(FINAL_VAL_LOSS_METRIC, last.val_loss, now_ms, last.epoch))
    if metrics:
        MlflowClient(job.run.tracking_uri).log_batch(job.run.run_id, metrics=metrics)
