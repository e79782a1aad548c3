"""Streaming ranks, for real: ddpflow.run() on a LocalCluster of worker processes trains from
shards (ddpflow.shards), a worker is SIGKILLed mid-epoch, a rank's memory is measured in its
worker process, the image folder is formatted on the cluster's workers, and the S3 store
goes away under a stream (a SeaweedFS server over HTTP, stopped)."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import distributed
import pytest
import torch

import ddpflow
from ddpflow.cluster.build import local_cluster
from ddpflow.shards.encoding import ShardEncoding
from ddpflow.shards.index import read_index, write_records
from ddpflow.shards.shard_file import ShardError
from ddpflow.shards.stream import ShardStream
from ddpflow.training.batching import epoch_batches
from ddpflow.workloads.vision.data import ImageSpec
from ddpflow.workloads.vision.digits import write_digits
from ddpflow.workloads.vision.shard_format import (
    format_chunk,
    format_shards,
    format_shards_on,
    plan_shards,
)
from infra.services import stop
from tests.helpers.grow_functions import samples_by_epoch
from tests.helpers.ranged_stream_functions import stream_fit_in_ranges
from tests.helpers.s3_servers import s3_env, start_test_seaweedfs, use_s3
from tests.helpers.stream_functions import stream_fit, stream_peak, write_split

pytestmark = pytest.mark.integration

SAMPLES = 480  # 12 shards of 40: 30 steps an epoch on 2 ranks of 8
WAIT_S = 120.0


@pytest.fixture(scope="module")
def cluster() -> distributed.Client:
    with local_cluster(2) as dask_cluster, distributed.Client(dask_cluster) as client:
        client.wait_for_workers(2, timeout=60)
        yield client


@pytest.fixture(scope="module")
def split(tmp_path_factory) -> str:
    uri = str(tmp_path_factory.mktemp("split") / "train.shards.json")
    write_split(uri, SAMPLES, 40)
    return uri


@pytest.fixture(scope="module")
def s3_ranks(tmp_path_factory) -> Iterator[tuple[distributed.Client, str, str]]:
    """The split in a SeaweedFS server (its URI, and that of its images as jpeg shards), and
    2 worker processes whose S3 it is."""
    service = start_test_seaweedfs(tmp_path_factory.mktemp("seaweedfs-resume"), ("resume",))
    try:
        uri = "s3://resume/data/train.shards.json"
        jpeg_uri = "s3://resume/jpeg/train.shards.json"
        with pytest.MonkeyPatch.context() as patch:
            use_s3(patch, service.url)
            write_split(uri, SAMPLES, 40)
            images, labels = ShardStream(read_index(uri)).batch(torch.arange(SAMPLES))
            jpeg = ShardEncoding("jpeg", 90)
            write_records(jpeg_uri, images.numpy(), labels.tolist(), 40, jpeg)
        with (
            local_cluster(2, env=s3_env(service.url)) as dask_cluster,
            distributed.Client(dask_cluster) as client,
        ):
            client.wait_for_workers(2, timeout=60)
            yield client, uri, jpeg_uri
    finally:
        stop(service)


def _train(
    client: distributed.Client,
    split: str,
    folder: Path,
    fit: Callable[..., dict] = stream_fit,
    **kwargs,  # noqa: ANN003
) -> dict:
    steps = folder / "steps"
    steps.mkdir(parents=True)
    return ddpflow.run(
        client,
        fit,
        split,
        str(steps),
        str(folder / "pause"),
        world_size=2,
        checkpoint_dir=str(folder / "checkpoints"),
        tracking_uri=f"sqlite:///{folder / 'mlflow.db'}",
        experiment="stream",
        **kwargs,
    )


def _steps_done(steps: Path) -> int:
    return max((len(p.read_text().splitlines()) for p in steps.glob("*-rank1.jsonl")), default=0)


# docs/data.md "Exact resume": a SIGKILLed worker resumes the stream from the last step
# checkpoint with the same samples, the same augmentation and the same dropout, so the
# weights are bitwise those of the run that was never interrupted; from local shards, and
# from S3 in parallel ranges (ddpflow.shards.parallel_reads), of raw and of jpeg shards
# (decoded ahead on the ranks' threads, ddpflow.shards.decoding).
@pytest.mark.parametrize("store", ["local", "s3", "s3-jpeg"])
def test_a_worker_killed_mid_epoch_resumes_the_stream_exactly(request, store, tmp_path):
    if store == "local":
        cluster, split = request.getfixturevalue("cluster"), request.getfixturevalue("split")
        fit = stream_fit
    else:
        cluster, raw, jpeg = request.getfixturevalue("s3_ranks")
        split = jpeg if store == "s3-jpeg" else raw
        fit = stream_fit_in_ranges
    straight = _train(cluster, split, tmp_path / "straight", fit)
    interrupted = tmp_path / "killed"
    interrupted.mkdir()
    (interrupted / "pause").touch()  # slow steps, so the kill lands inside epoch 1
    restarts: list[ddpflow.Restart] = []

    def restarted(restart: ddpflow.Restart) -> None:
        restarts.append(restart)
        (interrupted / "pause").unlink(missing_ok=True)

    def kill_after_seven_steps() -> None:
        deadline = time.monotonic() + WAIT_S
        while _steps_done(interrupted / "steps") < 7 and time.monotonic() < deadline:
            time.sleep(0.05)
        pids = cluster.run(os.getpid)
        os.kill(sorted(pids.values())[0], signal.SIGKILL)

    killer = threading.Thread(target=kill_after_seven_steps)
    killer.start()
    resumed = _train(cluster, split, interrupted, fit, max_restarts=1, on_restart=restarted)
    killer.join()
    assert len(restarts) == 1
    epochs = samples_by_epoch(str(interrupted / "steps"), SAMPLES)
    assert len(epochs) == 2
    for number, seen in enumerate(epochs, start=1):
        assert sorted(seen) == list(range(SAMPLES)), f"epoch {number}: each sample once"
    for ours, theirs in zip(resumed["weights"], straight["weights"], strict=True):
        assert torch.equal(ours, theirs), "the resumed weights differ from the straight run's"


# docs/data.md "Memory": a rank holds the shards its batches span plus the read-ahead,
# whatever the size of the dataset.
def test_a_rank_streams_a_dataset_four_times_its_budget_within_the_budget(cluster, tmp_path):
    budget_mb = 48
    uri = str(tmp_path / "big.shards.json")
    per_shard = 2 * 2**20 // (3 * 64 * 64)  # 2 MiB shards of 64 px images
    write_split(uri, 104 * per_shard, per_shard, side=64)
    size_mb = read_index(uri).nbytes / 2**20
    assert size_mb >= 4 * budget_mb
    ddpflow.run(cluster, stream_peak, uri, 64, str(tmp_path), world_size=2)
    for rank in (json.loads(p.read_text()) for p in tmp_path.glob("rank*.json")):
        assert rank["samples"] >= 104 * per_shard // 2 - 64
        # Measured: 18.5-20.8 MiB with 5 shards of 2 MiB held at most (the reads' buffers
        # and the allocator keep about as much again); reading ahead without a bound: 194.
        assert rank["rise_mb"] < budget_mb, (rank, size_mb)


# docs/data.md "Formatting": the chunks, formatted on 2 workers, make the same shards as
# in one process; a rerun reuses the format, and a changed file reformats only its chunk.
def test_formatting_on_two_workers_writes_the_shards_of_one_process(cluster, tmp_path):
    folder = write_digits(str(tmp_path / "digits")).uri
    spec = ImageSpec(16)

    def plan(store: str):  # noqa: ANN202
        return plan_shards(folder, store, spec, 0.2, 0, 20, shard_mb=0.1)

    here = format_shards(plan(str(tmp_path / "one")), 0.0)
    there = format_shards_on(cluster, plan(str(tmp_path / "two")), 0.0)
    for a, b in ((here.train_uri, there.train_uri), (here.val_uri, there.val_uri)):
        assert read_index(a).shards == read_index(b).shards
        assert len(read_index(a).shards) > 2
    assert (here.num_train, here.num_val) == (there.num_train, there.num_val) == (1438, 359)
    assert format_shards(plan(str(tmp_path / "two")), 0.0).reused
    changed = sorted((tmp_path / "digits").glob("*/*.png"))[5]
    os.utime(changed, (1, 1))
    again = plan(str(tmp_path / "two"))
    redone = [format_chunk(again.target, chunk) for chunk in again.chunks]
    assert sum(not r.reused for r in redone) == 1


# docs/data.md "Bad shards": the store gone mid-epoch is retried for a bounded time, then
# the batch fails naming the shard: never a hang, never a skipped sample.
def test_an_s3_outage_mid_epoch_fails_the_batch_naming_the_shard(tmp_path, monkeypatch):
    service = start_test_seaweedfs(tmp_path / "seaweedfs", ("stream",))
    try:
        use_s3(monkeypatch, service.url)
        uri = "s3://stream/data/train.shards.json"
        write_split(uri, 120, 20)
        # Ranges of 4 KiB, 8 KiB of them out or ahead at most (a shard is 15,520 bytes):
        # the rest of the epoch is still to read when the server stops.
        stream = ShardStream(
            read_index(uri),
            window=1,
            read_bound_s=5,
            chunk_bytes=4096,
            max_bytes_in_flight=8192,
        )
        batches = epoch_batches(len(stream), 10, 0, 1, 0, 0, order=stream.epoch_order)
        stream.start_epoch(0, batches)
        stream.batch(batches[0])
    finally:
        stop(service)
    started = time.monotonic()
    with pytest.raises(ShardError, match=r"shard s3://stream/data/shards/\w+\.shard") as error:
        for index in batches[1:]:
            stream.batch(index)
    assert time.monotonic() - started < 60
    assert "could not be read" in str(error.value) and "store is unreachable" in str(error.value)
    stream.close()  # the ranges still retrying stop at their next pause
