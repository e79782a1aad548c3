"""stream_fit (tests.helpers.stream_functions) with its streams reading parallel ranges
small enough to plan: a module of its own, so that the Dask worker processes import it by
name."""

from __future__ import annotations

from functools import partial
from unittest import mock

import ddpflow
from ddpflow.shards.stream import ShardStream
from tests.helpers import stream_functions

# A shard of the streaming tests' split is 31,040 bytes: 8 ranges of 4 KiB, 4 out at once
# and 16 KiB out or ahead at most, so the plan, not one GET a shard, delivers each epoch.
RANGES = {"requests_in_flight": 4, "chunk_bytes": 4096, "max_bytes_in_flight": 16384}


def stream_fit_in_ranges(
    ctx: ddpflow.TrainContext, index_uri: str, log_dir: str, pause: str
) -> dict:
    """stream_fit, every ShardStream it makes reading in RANGES (its split in an object
    store: local shards are read whole whatever the settings)."""
    with mock.patch.object(stream_functions, "ShardStream", partial(ShardStream, **RANGES)):
        return stream_functions.stream_fit(ctx, index_uri, log_dir, pause)
