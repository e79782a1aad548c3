"""How a rank streams a sharded split: free of torch, so a job that carries it can be built
in the flow process (which starts without torch)."""

from __future__ import annotations

from dataclasses import dataclass

# Shards shuffled together (ddpflow.shards.order): a rank holds about two windows at a
# window's edge, so this is the main term of its data memory, with `prefetch`.
DEFAULT_WINDOW = 4
DEFAULT_PREFETCH = 2  # shards read ahead of the batches in use
# How long a shard read retries a store that does not answer (connection refused, 5xx,
# timeouts) before the rank fails naming the shard: a blip is ridden out; an outage ends
# the attempt, and the launcher's restart resumes from the last step checkpoint.
DEFAULT_READ_BOUND_S = 120.0


@dataclass(frozen=True)
class StreamSettings:
    window: int = DEFAULT_WINDOW
    prefetch: int = DEFAULT_PREFETCH
    read_bound_s: float = DEFAULT_READ_BOUND_S

    def __post_init__(self) -> None:
        if self.window < 1:
            raise ValueError(f"stream window={self.window} must be >= 1 shard")
        if self.prefetch < 0:
            raise ValueError(f"stream prefetch={self.prefetch} must be >= 0 shards")
        if not self.read_bound_s > 0:
            raise ValueError(f"stream read_bound_s={self.read_bound_s} must be above 0 seconds")
