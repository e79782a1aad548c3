"""A rank's shards from a shaped S3 endpoint: ranged reads in parallel against one GET at a time.

    .venv/bin/python -m bench.parallel_reads [--quick] [--record] [--latency-ms 30]
        [--rate-mbps 80] [--data-mb 384] [--shard-mb 16] [--chunk-mb 8] [--image-size 64]

On real S3 one GET runs at one connection's rate (50-100 MB/s) after a first-byte latency
(about 30 ms), so a rank that reads one shard at a time is capped far below the ~400 MB/s a
GPU consumes. This measures what ddpflow.shards.parallel_reads delivers there instead:

1. A SeaweedFS server on 127.0.0.1 (the tests' S3 server, infra.seaweedfs) holds a split of
   random uint8 records [3, S, S] (S=64: 12 KiB a sample) in shards of --shard-mb, written
   to it directly; in front of it the shaping proxy bench.s3_shaper, as its own process:
   each response's first byte --latency-ms after its request, each connection paced to
   --rate-mbps (MB = 10^6 bytes).
2. One rank (world_size=1) takes every batch of an epoch (batch 64) into a no-op step, as
   fit() runs it (the epoch's window order, epoch_batches, start_epoch, each batch), from a
   ShardStream whose S3 endpoint is the proxy:
   (a) the baseline, one GET at a time: requests_in_flight=1, one range per shard (the
       reader before parallel reads: one whole-shard GET each, the next after it);
   (b) requests_in_flight 1, 4, 8, 16 in ranges of --chunk-mb, the default byte bound;
   (c) requests_in_flight 16 against SeaweedFS directly, unshaped: what the CPUs here allow.
   Each is the best of 2 epochs (--quick: 1); delivered bytes/s (MB/s) and samples/s.
   The shaping's ceiling for N requests is N x chunk / (latency + chunk / rate); the CPU
   figures (this process, the proxy and SeaweedFS, from psutil) say which one binds.
3. How the requests are made, measured on the same ranges (every range of the split, 16 at
   once, through the proxy): a pool of threads over s3fs's blocking cat_file (what
   parallel_reads does) against s3fs's asyncio _cat_ranges on its own event loop.

The target, at 16 requests: >= 6x the one-at-a-time reader, and within 20 % of the lower of
the shaping's ceiling and the unshaped (CPU) figure. `--record` writes the entry
parallel_reads of results/latest.json.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil
import s3fs
import torch
from fsspec.asyn import sync

from bench.common import (
    BENCH_THREADS,
    Result,
    command_line,
    load_average,
    print_results,
    record_entry,
)
from bench.streaming import synthetic, write_split
from ddpflow.shards.index import read_index
from ddpflow.shards.range_read import range_fs, shard_ranges
from ddpflow.shards.stream import ShardStream
from ddpflow.training.batching import epoch_batches
from infra.procs import free_port
from infra.runtime import REPO

BATCH_SIZE = 64
SEED = 0
BUCKET = "ddpflow-bench"
MiB = 2**20
MB = 1e6
IN_FLIGHT = (1, 4, 8, 16)


@dataclass(frozen=True)
class Sizes:
    image_size: int
    data_mb: float
    shard_mb: float
    chunk_mb: float
    latency_s: float
    rate: float  # bytes/s a connection
    epochs: int

    @property
    def chunk(self) -> int:
        return int(self.chunk_mb * MiB)


@dataclass(frozen=True)
class Server:
    url: str
    env: dict[str, str]  # the AWS variables of its administrator
    pid: int


@contextlib.contextmanager
def seaweedfs(folder: Path) -> Iterator[Server]:
    """A SeaweedFS server with BUCKET, stopped after the block."""
    from infra.seaweedfs.config import Identity, S3Key
    from infra.seaweedfs.server import start_seaweedfs
    from infra.services import stop

    admin = Identity("bench-admin", S3Key.new())
    service = start_seaweedfs(
        free_port(), folder / "data", folder / "config", folder, [admin], (BUCKET,)
    )
    service.stop_wait_s = 0.0  # its data goes with the folder
    try:
        env = {**admin.key.env(), "AWS_DEFAULT_REGION": "us-east-1"}
        yield Server(service.url, {**env, "AWS_EC2_METADATA_DISABLED": "true"}, service.pid)
    finally:
        stop(service)


@contextlib.contextmanager
def shaper(upstream: str, sizes: Sizes, log: Path) -> Iterator[tuple[str, int]]:
    """bench.s3_shaper in front of `upstream`, its own process; (its URL, its pid)."""
    port = free_port()
    with open(log, "wb") as out:
        process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "bench.s3_shaper",
                "--upstream",
                upstream,
                "--port",
                str(port),
                "--latency-ms",
                str(sizes.latency_s * 1000),
                "--rate-mbps",
                str(sizes.rate / MB),
            ],
            cwd=REPO,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        deadline = time.monotonic() + 30
        while b"shaping" not in log.read_bytes():
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the shaper did not start: {log.read_text()}")
            time.sleep(0.05)
        yield f"http://127.0.0.1:{port}", process.pid
    finally:
        process.terminate()
        process.wait(10)


@contextlib.contextmanager
def endpoint(url: str, env: dict[str, str]) -> Iterator[None]:
    """This process's S3 is `url` for the block (storage.s3_options reads the variable);
    s3fs's cached clients are dropped before and after, so no connection is reused across."""
    values = {**env, "AWS_ENDPOINT_URL_S3": url}
    saved = {key: os.environ.get(key) for key in values}
    os.environ.update(values)
    s3fs.S3FileSystem.clear_instance_cache()
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        s3fs.S3FileSystem.clear_instance_cache()


def cpu_of(pid: int) -> float:
    """User + system CPU seconds of a process and its children alive now."""
    try:
        process = psutil.Process(pid)
        members = [process, *process.children(recursive=True)]
    except psutil.Error:
        return 0.0
    total = 0.0
    for member in members:
        with contextlib.suppress(psutil.Error):
            times = member.cpu_times()
            total += times.user + times.system
    return total


def timed(fn: Callable[[], Any], pids: dict[str, int]) -> dict[str, float]:
    """Wall seconds of fn and the CPU seconds each process spent meanwhile."""
    before = {name: cpu_of(pid) for name, pid in pids.items()}
    client = time.process_time()
    started = time.perf_counter()
    fn()
    wall = time.perf_counter() - started
    found = {"wall_s": wall, "client_cpu_s": time.process_time() - client}
    for name, pid in pids.items():
        found[f"{name}_cpu_s"] = cpu_of(pid) - before[name]
    return found


def stream_epoch(stream: ShardStream, epoch: int) -> None:
    batches = epoch_batches(len(stream), BATCH_SIZE, 0, 1, SEED, epoch, order=stream.epoch_order)
    stream.start_epoch(epoch, batches)
    for index in batches:
        stream.batch(index)  # the no-op step


def measure_stream(
    index_uri: str,
    sizes: Sizes,
    requests: int,
    chunk: int,
    max_bytes: int | None,
    epochs: int,
    pids: dict[str, int],
) -> dict[str, Any]:
    """The best of `epochs` epochs of one stream (new for the run, so no shard is cached)."""
    kwargs: dict[str, Any] = {"requests_in_flight": requests, "chunk_bytes": chunk}
    if max_bytes is not None:
        kwargs["max_bytes_in_flight"] = max_bytes
    stream = ShardStream(read_index(index_uri), **kwargs)
    runs = []
    for epoch in range(epochs):
        runs.append(timed(lambda e=epoch: stream_epoch(stream, e), pids))
    assert stream.ranges is not None
    counters = stream.ranges.counters
    stream.close()
    best = min(runs, key=lambda r: r["wall_s"])
    nbytes = stream.index.nbytes
    return {
        **best,
        "mb_s": nbytes / best["wall_s"] / MB,
        "samples_s": len(stream) / best["wall_s"],
        "epochs_mb_s": [nbytes / r["wall_s"] / MB for r in runs],
        "peak_requests": counters.peak_requests,
        "peak_bytes_mib": counters.peak_bytes / MiB,
    }


def shaped_ceiling(sizes: Sizes, requests: int, chunk: int) -> float:
    """MB/s of `requests` connections each asking `chunk` bytes at a time, shaped."""
    return requests * chunk / (sizes.latency_s + chunk / sizes.rate) / MB


def measure_engines(index_uri: str, sizes: Sizes, pids: dict[str, int]) -> dict[str, Any]:
    """Every range of the split, 16 at once, by threads over cat_file and by _cat_ranges."""
    index = read_index(index_uri)
    ranges = list(shard_ranges(index.shards, range(len(index.shards)), sizes.chunk))
    fs, _ = range_fs(index_uri, 16)
    paths = [fs._strip_protocol(index.uri(index.shards[r.shard])) for r in ranges]
    total = sum(r.nbytes for r in ranges)

    def threads() -> None:
        with ThreadPoolExecutor(16) as pool:
            got = pool.map(
                lambda i: len(fs.cat_file(paths[i], start=ranges[i].start, end=ranges[i].end)),
                range(len(ranges)),
            )
            assert sum(got) == total

    def asyncio_ranges() -> None:
        got = sync(
            fs.loop,
            fs._cat_ranges,
            paths,
            [r.start for r in ranges],
            [r.end for r in ranges],
            batch_size=16,
        )
        assert sum(len(g) for g in got) == total

    found: dict[str, Any] = {}
    for name, fn in (("threads", threads), ("asyncio", asyncio_ranges)) * sizes.epochs:
        run = timed(fn, pids)
        run["mb_s"] = total / run["wall_s"] / MB
        if name not in found or run["wall_s"] < found[name]["wall_s"]:
            found[name] = run
    return found


def cpu_note(run: dict[str, Any]) -> str:
    wall = run["wall_s"]
    parts = [
        f"{name.removesuffix('_cpu_s')} {run[name] / wall:.2f}"
        for name in run
        if name.endswith("_cpu_s")
    ]
    busy = sum(run[name] for name in run if name.endswith("_cpu_s")) / wall
    return f"CPUs busy {busy:.2f} of {os.cpu_count()} ({', '.join(parts)})"


def measure(sizes: Sizes, folder: Path) -> dict[str, Any]:
    record_bytes = 3 * sizes.image_size**2
    num = int(sizes.data_mb * MiB // record_bytes)
    images, labels = synthetic(num, (3, sizes.image_size, sizes.image_size), SEED)
    found: dict[str, Any] = {"samples": num}
    with seaweedfs(folder / "seaweedfs") as store:
        server, env, server_pid = store.url, store.env, store.pid
        index_uri = f"s3://{BUCKET}/split/train.shards.json"
        with endpoint(server, env):
            index = write_split(index_uri, images, labels, sizes.shard_mb)
        del images, labels
        largest = max(s.nbytes for s in index.shards)
        found["shards"], found["data_mib"] = len(index.shards), index.nbytes / MiB
        with shaper(server, sizes, folder / "shaper.log") as (shaped, shaper_pid):
            pids = {"shaper": shaper_pid, "seaweedfs": server_pid}
            with endpoint(shaped, env):
                found["one_at_a_time"] = measure_stream(
                    index_uri, sizes, 1, largest, 2 * largest, sizes.epochs, pids
                )
                print(f"one GET at a time: {found['one_at_a_time']['mb_s']:.0f} MB/s", flush=True)
                for n in IN_FLIGHT:
                    run = measure_stream(index_uri, sizes, n, sizes.chunk, None, sizes.epochs, pids)
                    found[f"in_flight_{n}"] = run
                    print(f"{n} in flight: {run['mb_s']:.0f} MB/s; {cpu_note(run)}", flush=True)
                found["engines"] = measure_engines(index_uri, sizes, pids)
        with endpoint(server, env):
            found["unshaped_16"] = measure_stream(
                index_uri, sizes, 16, sizes.chunk, None, sizes.epochs, {"seaweedfs": server_pid}
            )
        print(f"unshaped, 16: {found['unshaped_16']['mb_s']:.0f} MB/s", flush=True)
    return found


def results(found: dict[str, Any], sizes: Sizes) -> list[Result]:
    base = found["one_at_a_time"]
    setting = (
        f"{found['samples']:,} samples of 3x{sizes.image_size}x{sizes.image_size} "
        f"({found['data_mib']:.0f} MiB) in {found['shards']} shards of ~{sizes.shard_mb:g} MiB, "
        f"batch {BATCH_SIZE}, no-op step, best of {sizes.epochs} epoch(s); shaped "
        f"{sizes.latency_s * 1000:g} ms + {sizes.rate / MB:g} MB/s a connection"
    )
    cpu_bound = found["unshaped_16"]["mb_s"]
    rows = []
    for n in IN_FLIGHT:
        run = found[f"in_flight_{n}"]
        ceiling = shaped_ceiling(sizes, n, sizes.chunk)
        bound = min(ceiling, cpu_bound)
        ratio = run["mb_s"] / base["mb_s"]
        met = ratio >= 6 and run["mb_s"] >= 0.8 * bound if n == 16 else None
        rows.append(
            Result(
                "parallel_reads",
                f"MB/s to a no-op step, {n} in flight, {sizes.chunk_mb:g} MiB ranges",
                run["mb_s"],
                base["mb_s"],
                "MB/s",
                ratio,
                ">= 6x one at a time, >= 80 % of the bound" if n == 16 else "info",
                met,
                f"{setting}; {run['samples_s']:,.0f} samples/s (one at a time "
                f"{base['samples_s']:,.0f}); shaping ceiling {ceiling:.0f} MB/s, unshaped 16 "
                f"in flight {cpu_bound:.0f} MB/s: {run['mb_s'] / bound:.0%} of the lower; "
                f"most requests out {run['peak_requests']}, most bytes out or ahead "
                f"{run['peak_bytes_mib']:.0f} MiB; {cpu_note(run)}; baseline {cpu_note(base)}",
            )
        )
    engines = found["engines"]
    rows.append(
        Result(
            "parallel_reads",
            "raw ranges, 16 at once: threads over cat_file vs asyncio _cat_ranges",
            engines["threads"]["mb_s"],
            engines["asyncio"]["mb_s"],
            "MB/s",
            engines["threads"]["mb_s"] / engines["asyncio"]["mb_s"],
            "threads / asyncio (info)",
            None,
            f"every {sizes.chunk_mb:g} MiB range of the split through the shaper; threads "
            f"{cpu_note(engines['threads'])}; asyncio {cpu_note(engines['asyncio'])}",
        )
    )
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = command_line(
        "bench.parallel_reads", __doc__, quick="128 MiB of data, 1 epoch", record="parallel_reads"
    )
    parser.add_argument("--image-size", type=int, default=64, help="record side (64)")
    parser.add_argument("--data-mb", type=float, help="MiB of records (384; quick 128)")
    parser.add_argument("--shard-mb", type=float, default=16, help="MiB a shard (16)")
    parser.add_argument("--chunk-mb", type=float, default=8, help="MiB a range (8)")
    parser.add_argument("--latency-ms", type=float, default=30, help="first-byte latency (30)")
    parser.add_argument("--rate-mbps", type=float, default=80, help="MB/s a connection (80)")
    args = parser.parse_args(argv)
    sizes = Sizes(
        image_size=args.image_size,
        data_mb=args.data_mb or (128 if args.quick else 384),
        shard_mb=args.shard_mb,
        chunk_mb=args.chunk_mb,
        latency_s=args.latency_ms / 1000,
        rate=args.rate_mbps * MB,
        epochs=1 if args.quick else 2,
    )
    torch.set_num_threads(BENCH_THREADS)  # as a rank runs (bench.common)
    command = "python -m bench.parallel_reads " + " ".join(sys.argv[1:] if argv is None else argv)
    started, load_before = time.time(), load_average()
    with tempfile.TemporaryDirectory(prefix="ddpflow-bench-parallel-reads-") as tmp:
        found = measure(sizes, Path(tmp))
    rows = results(found, sizes)
    print_results("delivered MB/s from a shaped S3, ranged reads in parallel", rows)
    if args.record:
        record_entry("parallel_reads", command, load_before, rows, started, measured=found)


if __name__ == "__main__":
    main()
