"""Which world sizes a scaling run trains at, checked before any training starts."""

from __future__ import annotations

from collections.abc import Sequence

FIX = "pass positive integers separated by commas, e.g. 1,2,4, or leave it unset for 1..N"


class ScalingConfigError(ValueError):
    """A `world_sizes` value that cannot be run; the message names the input and the fix."""


def parse_world_sizes(text: str | None) -> list[int] | None:
    """`"1,2,4"` -> [1, 2, 4], ascending and without repeats; None or blank -> None (all).

    Sizes run smallest first, so the size-1 baseline of the efficiency exists early and a
    run cut short still has its smallest, cheapest sizes.
    """
    if text is None or not str(text).strip():
        return None
    sizes = []
    for item in str(text).split(","):
        try:
            size = int(item.strip())
        except ValueError:
            raise ScalingConfigError(
                f"world_sizes={text!r}: {item.strip()!r} is not an integer; {FIX}"
            ) from None
        if size < 1:
            raise ScalingConfigError(
                f"world_sizes={text!r}: {size} is not a positive world size; {FIX}"
            )
        sizes.append(size)
    return sorted(set(sizes))


def plan_world_sizes(sizes: Sequence[int] | None, num_workers: int) -> list[int]:
    """The sizes to run on a cluster of `num_workers` rank workers; default 1..num_workers.

    Each size needs that many workers at once (one rank per worker), so a size above the
    cluster's count could never start: it fails here, before any data is read.
    """
    if num_workers < 1:
        raise ScalingConfigError(
            "the cluster has no worker that can run a rank; start workers "
            "(DDPFLOW_DASK_WORKERS for the local cluster) and run again"
        )
    if sizes is None:
        return list(range(1, num_workers + 1))
    too_big = [s for s in sizes if s > num_workers]
    if too_big:
        given = ",".join(map(str, sizes))
        raise ScalingConfigError(
            f"world_sizes={given}: {','.join(map(str, too_big))} larger than the cluster's "
            f"{num_workers} worker(s); pass sizes up to {num_workers} or add workers "
            "(DDPFLOW_DASK_WORKERS for the local cluster)"
        )
    return list(sizes)
