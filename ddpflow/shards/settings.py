"""How a rank streams a sharded split: free of torch, so a job that carries it can be built
in the flow process (which starts without torch)."""

from __future__ import annotations

from dataclasses import dataclass

# Shards shuffled together (ddpflow.shards.order): a rank holds about two windows at a
# window's edge, so this is the main term of its data memory, with `prefetch`.
DEFAULT_WINDOW = 4
DEFAULT_PREFETCH = 2  # shards read ahead of the batches in use


@dataclass(frozen=True)
class StreamSettings:
    window: int = DEFAULT_WINDOW
    prefetch: int = DEFAULT_PREFETCH

    def __post_init__(self) -> None:
        if self.window < 1:
            raise ValueError(f"stream window={self.window} must be >= 1 shard")
        if self.prefetch < 0:
            raise ValueError(f"stream prefetch={self.prefetch} must be >= 0 shards")
