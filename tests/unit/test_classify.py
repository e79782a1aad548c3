"""A rank's exception classified by its type (ddpflow.distributed.supervisor.classify); the
real errors of a gloo group are classified in integration/test_failure_classification.py."""

from __future__ import annotations

import pytest
import torch.distributed as dist
from distributed import KilledWorker
from distributed.protocol import pickle

from ddpflow.distributed.main_io import MainRankFailed
from ddpflow.distributed.supervisor import graceful_stop
from ddpflow.distributed.supervisor.classify import classify
from ddpflow.distributed.supervisor.failures import FailureKind
from ddpflow.distributed.supervisor.graceful_stop import PEER_STOP, StopReason, StopRequested
from ddpflow.storage.redact import redacted_error

GROW = StopReason(FailureKind.GROW, "stop_grow", {"old": 2, "new": 3, "joined": "tcp://c:1"})
GLOO_RESET = (
    "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:545] Read error "
    "[127.0.0.1]:18822: Connection reset by peer."
)


@pytest.mark.parametrize(
    ("reason", "kind"),
    [
        (graceful_stop.leaving("tcp://a:1", "stop_sigterm"), FailureKind.PREEMPTED),
        (graceful_stop.leaving("tcp://a:1", "stop_worker_closing"), FailureKind.PREEMPTED),
        (graceful_stop.leaving("tcp://a:1", "stop_nanny_closing"), FailureKind.PREEMPTED),
        (GROW, FailureKind.GROW),
        (PEER_STOP, FailureKind.PEER_STOPPED),
    ],
)
def test_a_stop_is_of_its_reason_s_kind_after_the_trip_through_dask(reason, kind):
    error = StopRequested(reason, epoch=2, step=20)
    assert redacted_error(error) is error, "nothing to redact: the type stays"
    arrived = pickle.loads(pickle.dumps(error))
    assert type(arrived) is StopRequested and classify(arrived) is kind
    assert str(arrived) == str(error)
    assert StopReason.from_event(reason.to_event()) == reason, "a stop's Dask event"


@pytest.mark.parametrize(
    ("error", "kind"),
    [
        (ValueError("hidden_size=0"), FailureKind.RAISED),
        (RuntimeError("CUDA out of memory"), FailureKind.RAISED),
        (ConnectionResetError("the data store reset the connection"), FailureKind.RAISED),
        (RuntimeError(GLOO_RESET), FailureKind.FOLLOW_ON),
        (dist.DistNetworkError("Failed to recv, got 0 bytes"), FailureKind.FOLLOW_ON),
        (dist.DistStoreError("Timed out after 121 seconds"), FailureKind.FOLLOW_ON),
        (dist.DistBackendError("NCCL communicator was aborted"), FailureKind.FOLLOW_ON),
        (MainRankFailed("rank 0 failed during its checkpoint"), FailureKind.FOLLOW_ON),
        (KilledWorker("ddp-rank0", "tcp://a:1", 3), FailureKind.WORKER_LOST),
    ],
    ids=lambda v: type(v).__name__ if isinstance(v, BaseException) else v.value,
)
def test_an_exception_is_classified_by_its_type(error: BaseException, kind: FailureKind):
    assert classify(error) is kind
    assert classify(pickle.loads(pickle.dumps(error))) is kind, "after Dask's pickling"
