"""An instrumented range reader for the parallel-reads tests: parallel_reads.read_range
counted, what is out at once and the order the ranges were asked for in."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from ddpflow.shards import parallel_reads
from ddpflow.shards.range_read import ShardRange
from ddpflow.shards.shard_file import ShardInfo


class CountedReads:
    """Put in place of parallel_reads.read_range (monkeypatch.setattr(parallel_reads,
    "read_range", CountedReads())): each range waits `delay_s` first, as a store's latency
    would, so the requests overlap."""

    def __init__(self, delay_s: float = 0.0) -> None:
        self.real = parallel_reads.read_range
        self.delay_s = delay_s
        self.lock = threading.Lock()
        self.requests = self.bytes = self.peak_requests = self.peak_bytes = 0
        self.asked: list[tuple[int, int]] = []  # (shard, start) as asked for

    def __call__(
        self,
        uri: str,
        info: ShardInfo,
        part: ShardRange,
        bound_s: float,
        connections: int,
        on_wait: Callable[[], None] | None = None,
    ) -> bytes:
        with self.lock:
            self.asked.append((part.shard, part.start))
            self.requests += 1
            self.bytes += part.nbytes
            self.peak_requests = max(self.peak_requests, self.requests)
            self.peak_bytes = max(self.peak_bytes, self.bytes)
        try:
            time.sleep(self.delay_s)
            return self.real(uri, info, part, bound_s, connections, on_wait)
        finally:
            with self.lock:
                self.requests -= 1
                self.bytes -= part.nbytes
