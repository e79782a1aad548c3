"""Every cause the supervisor writes for people: the words, and only the words.

A failure's kind and its details decide what happens next (policy.py); the words only say
it. Nothing reads them back, so rewording one changes no decision:
integration/test_reworded_causes.py rewords every template here and runs a failure of each
kind through the launcher, which behaves the same.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ddpflow.distributed.supervisor.failures import RankFailure, root_causes_first

# Template name -> its words (str.format fields, filled by `words`).
MESSAGES: dict[str, str] = {
    # A failed group, one line: its ranks' causes, the root one first.
    "group_failed": "DDP group failed: {ranks}",
    "group_failed_while_starting": "DDP group failed while starting: {ranks}",
    "group_could_not_start": "DDP group could not start: {ranks}",
    "group_stalled": "DDP group stalled: {ranks}",
    "group_stopped": "DDP group stopped: {ranks}",
    "rank_cause": "rank {rank} on worker {worker}: {cause}",
    # One rank's cause.
    "raised": "{error}",  # the rank's exception, `Type: message`, redacted
    "worker_left": "its worker left the cluster (died or restarted)",
    "task_status": "task {status}",  # a rank task Dask cancelled or lost, without an error
    "left_after_stop": "{reason}; it stopped its rank and left the cluster",
    "stalled": "no training step for more than {timeout_s:g} s (rank_timeout_s)",
    "stalled_silent": (
        "no training step for more than {timeout_s:g} s (rank_timeout_s); its worker does not "
        "answer (hung or cut off)"
    ),
    "not_started": (
        "did not start within {timeout_s:g}s (task state: {status}; the worker is busy, gone "
        "or overloaded)"
    ),
    "no_answer": (
        "its worker did not answer {question}() within {timeout_s:g}s (hung, overloaded or cut off)"
    ),
    # Why a group was asked to stop at its next control step.
    "stop_sigterm": "worker {worker} asked to stop (SIGTERM)",
    "stop_worker_closing": (
        "worker {worker} asked to stop (its worker is closing: retire_workers or its nanny)"
    ),
    "stop_nanny_closing": (
        "worker {worker} asked to stop (its nanny is closing: SIGTERM to dask worker or a shutdown)"
    ),
    "stop_grow": "the group grows ({old} -> {new} ranks: worker(s) {joined} joined)",
    "stop_peer": "another worker of the group was asked to stop",
    # A rank's StopRequested: the stop's reason and where the group checkpointed.
    "stopped_in_epoch": (
        "{reason}; the group checkpointed at epoch {epoch} step {step} and resumes there"
    ),
    "stopped_at_epoch_end": (
        "{reason}; the group checkpointed at the end of epoch {epoch} and resumes there"
    ),
    "stopped_at_step": "{reason}; the group checkpointed at step {step}",  # a loop of its own
}


def words(message: str, **details: Any) -> str:
    """The words of template `message` with its details filled in."""
    return MESSAGES[message].format(**details)


def describe(outcome: str, failures: Sequence[RankFailure]) -> str:
    """A failed group in one line, its first cause the root one (root_causes_first).
    `outcome` names the line's template ("group_failed", "group_stopped", ...)."""
    lines = [
        words("rank_cause", rank=f.rank, worker=f.worker_address, cause=f.cause)
        for f in root_causes_first(failures)
    ]
    return words(outcome, ranks="; ".join(lines))
