"""Rank functions the integration tests launch: here, in a module of their own, so Dask
workers in other processes (and on other hosts) import them by name."""

from __future__ import annotations

import time
from pathlib import Path

from ddpflow.distributed import RankContext


def stuck_once(ctx: RankContext, marker_dir: str) -> float:
    """First attempt: rank 0 fails at once, rank 1 is stuck and keeps its worker's thread.

    It lives here, not in the test module, so the workers can import it by name."""
    marker = Path(marker_dir) / f"rank{ctx.rank}"
    if not marker.exists():
        marker.write_text(str(time.time()))
        if ctx.rank == 0:
            raise RuntimeError("rank 0 fails on purpose")
        time.sleep(120)
    return time.time()


def advertise_loopback_once() -> None:
    """Run on the workers (fault injection): the next rank on each binds gloo to 127.0.0.1,
    as stock gloo does where /etc/hosts maps the host name to loopback, so the rendezvous
    across hosts fails as it did before ranks bound their worker's address."""
    from ddpflow.distributed import context

    original = context.bound_gloo_options

    def loopback(host: str, timeout):  # noqa: ANN001, ANN202
        context.bound_gloo_options = original
        return original("127.0.0.1", timeout)

    context.bound_gloo_options = loopback


def started_at(ctx: RankContext) -> float:
    return time.time()


def hold_until(ctx: RankContext, holding: str, release: str) -> float:
    """Keep the group's workers until the Dask Event `release` is set, beating meanwhile so
    the step watchdog sees progress; rank 0 sets `holding` once the group has formed.
    Returns when this rank let go (time.time())."""
    import distributed
    import torch.distributed as dist

    client = distributed.get_client()
    if ctx.rank == 0:
        distributed.Event(holding, client=client).set()
    done = distributed.Event(release, client=client)
    while not done.wait(0.2):
        ctx.heartbeat()
    dist.barrier()
    return time.time()


def mlflow_fails_once(ctx: RankContext, tracking_uri: str, marker_dir: str) -> int:
    """First attempt: MLflow's own error for a tracking server that is down, which quotes
    the tracking URI, user:password@ included. Later attempts succeed."""
    marker = Path(marker_dir) / f"rank{ctx.rank}"
    if not marker.exists():
        marker.write_text(str(time.time()))
        import os

        from mlflow.tracking import MlflowClient

        os.environ["MLFLOW_HTTP_REQUEST_MAX_RETRIES"] = "0"  # fail at once, not after minutes
        MlflowClient(tracking_uri).get_experiment("0")
    return ctx.rank


def join_slowly_once(joined_file: str, delay_s: float) -> None:
    """Run on one worker (fault injection): its next rank's join returns `delay_s` late
    and notes when, as a worker that started slower than its peers would join."""
    import torch.distributed as dist

    original = dist.init_process_group

    def slow(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        dist.init_process_group = original
        original(*args, **kwargs)
        time.sleep(delay_s)
        Path(joined_file).write_text(str(time.time()))

    dist.init_process_group = slow
