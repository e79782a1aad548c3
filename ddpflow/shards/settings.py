"""How a rank streams a sharded split: free of torch, so a job that carries it can be built
in the flow process (which starts without torch)."""

from __future__ import annotations

from dataclasses import dataclass

MiB = 2**20

# Shards shuffled together (ddpflow.shards.order): a rank holds about two windows at a
# window's edge, so this is the main term of its data memory, with the read-ahead below.
DEFAULT_WINDOW = 4
DEFAULT_PREFETCH = 2  # local shards read ahead of the batches in use
# How long a shard read retries a store that does not answer (connection refused, 5xx,
# timeouts) before the rank fails naming the shard: a blip is ridden out; an outage ends
# the attempt, and the launcher's restart resumes from the last step checkpoint.
DEFAULT_READ_BOUND_S = 120.0
# Shards in an object store are read as ranged GETs of this size, several at once: one GET
# runs at one connection's rate (50-100 MB/s on S3), a GPU wants about 400 MB/s. 8 MiB
# takes about 100 ms at 80 MB/s, so S3's first-byte latency (about 30 ms) costs a quarter
# of a request, and a 64 MiB shard is 8 requests that can run side by side.
DEFAULT_CHUNK_BYTES = 8 * MiB
# 16 ranges of 8 MiB in flight: 16 x 62 MB/s (30 ms + 8 MiB at 80 MB/s each) is about
# 1 GB/s a rank, twice and more what a GPU consumes, on a shaped S3 (bench.parallel_reads).
DEFAULT_REQUESTS_IN_FLIGHT = 16
# Bytes read ahead of the batches in use (in flight, or arrived for shards no batch needs
# yet): twice what 16 requests of 8 MiB have out at once, so a finished range's slot is
# refilled while the shards it completed wait for their batch. 256 MiB a rank, 2 GiB for 8
# ranks on a GPU host, on top of the shards the current batches span.
DEFAULT_MAX_BYTES_IN_FLIGHT = 256 * MiB
# Compressed (jpeg) shards: threads that decode the records of the rank's next batches while
# its step runs (torchvision's decode releases the GIL: decoding alone, 2 threads did 1.9x
# what one does on 2 free cores), and how many batches they may decode ahead of the one in
# use; the decoded batches are the memory this costs (5 x 32 images of 224 px: 24 MiB).
DEFAULT_DECODE_THREADS = 2
DEFAULT_DECODE_AHEAD = 4


@dataclass(frozen=True)
class StreamSettings:
    window: int = DEFAULT_WINDOW
    prefetch: int = DEFAULT_PREFETCH
    read_bound_s: float = DEFAULT_READ_BOUND_S
    requests_in_flight: int = DEFAULT_REQUESTS_IN_FLIGHT
    max_bytes_in_flight: int = DEFAULT_MAX_BYTES_IN_FLIGHT
    chunk_bytes: int = DEFAULT_CHUNK_BYTES
    decode_threads: int = DEFAULT_DECODE_THREADS
    decode_ahead: int = DEFAULT_DECODE_AHEAD

    def __post_init__(self) -> None:
        if self.window < 1:
            raise ValueError(f"stream window={self.window} must be >= 1 shard")
        if self.prefetch < 0:
            raise ValueError(f"stream prefetch={self.prefetch} must be >= 0 shards")
        if not self.read_bound_s > 0:
            raise ValueError(f"stream read_bound_s={self.read_bound_s} must be above 0 seconds")
        if self.requests_in_flight < 1:
            raise ValueError(
                f"stream requests_in_flight={self.requests_in_flight} must be >= 1 request"
            )
        if self.decode_threads < 1:
            raise ValueError(f"stream decode_threads={self.decode_threads} must be >= 1 thread")
        if self.decode_ahead < 1:
            raise ValueError(f"stream decode_ahead={self.decode_ahead} must be >= 1 batch")
        if self.chunk_bytes < 1:
            raise ValueError(f"stream chunk_bytes={self.chunk_bytes} must be >= 1 byte")
        if self.max_bytes_in_flight < self.chunk_bytes:
            # A smaller bound could never let a range start ahead of the batches in use.
            raise ValueError(
                f"stream max_bytes_in_flight={self.max_bytes_in_flight} must be >= "
                f"chunk_bytes={self.chunk_bytes}"
            )
