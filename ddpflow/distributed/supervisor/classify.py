"""The kind of a rank's exception, decided once, where the launcher reads it from the rank's task.

By its type: the rank's exception reaches the launcher with it (Dask pickles it, and the
rank's redaction keeps it: ddpflow.storage.redact.redacted_error). torch's own types say
when a collective or the group's store failed (DistNetworkError, DistStoreError,
DistBackendError), which in a group means that a peer, or rank 0 serving the store, failed
or went away. Only gloo's transport errors come as a plain RuntimeError in torch 2.14 (a
peer killed: "Connection reset by peer"; a peer that raised and left the group: "Connection
closed by peer"; a peer hung: "Timed out waiting ... for recv"), and they are recognised by
the one thing they all carry: gloo's source path. Nothing of ddpflow's own words is read.
"""

from __future__ import annotations

import re
import sys

from distributed import KilledWorker

from ddpflow.distributed.main_io import MainRankFailed
from ddpflow.distributed.supervisor.failures import FailureKind
from ddpflow.distributed.supervisor.graceful_stop import StopRequested

# gloo prefixes its errors with the source file that raised them, e.g.
# "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:545] Read error ...".
_GLOO_TRANSPORT = re.compile(r"\bgloo/transport/")


def classify(error: BaseException) -> FailureKind:
    """What a rank's exception says about its failure."""
    if isinstance(error, StopRequested):
        return error.reason.kind  # asked to leave, to grow, or with a peer that was
    if isinstance(error, MainRankFailed):
        return FailureKind.FOLLOW_ON  # rank 0's IO failed; its own error names the cause
    if isinstance(error, KilledWorker):
        return FailureKind.WORKER_LOST
    # An error of torch's own types means torch.distributed is imported in this process;
    # the launcher's process does not import torch for anything else.
    dist = sys.modules.get("torch.distributed")
    if dist is not None and isinstance(error, dist.DistError):
        return FailureKind.FOLLOW_ON
    if type(error) is RuntimeError and _GLOO_TRANSPORT.search(str(error)):
        return FailureKind.FOLLOW_ON
    return FailureKind.RAISED
