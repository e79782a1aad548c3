"""What streaming a split from shards costs against holding it in memory, and what it saves.

    .venv/bin/python -m bench.streaming [--quick] [--image-size S] [--record] [...]

A split too large for every rank's memory is formatted into shards (ddpflow.shards) and
streamed: each rank reads only the shards its batches need, a bounded number at a time. This
measures the three things that trade-off is about, each against a baseline from the same run:

1. Delivered samples/s to a no-op training step: one rank (world_size=1) takes every batch
   of an epoch (batch 64) and drops it, on the same synthetic uint8 records [3, S, S]
   (S=64 by default; ~256 MiB, --quick ~32 MiB), from
   (a) the in-memory path, `ImageSplit.batch` in epoch_batches' uniform order: the baseline;
   (b) a ShardStream over local shards (16 MiB each, --quick 4; window 4, prefetch 2);
   (c) a ShardStream over the same shards in a moto S3 server on 127.0.0.1 (HTTP, s3fs).
   An epoch is timed as fit() runs it: the order and epoch_batches, start_epoch, the batches.
   The three take turns within each epoch; the figure is the best of 2 epochs. The local
   shards are evicted from the page cache (posix_fadvise DONTNEED) before the first epoch,
   so epoch 1 reads the disk and epoch 2 most likely the page cache: both are printed.
2. Peak RSS of a rank streaming one epoch at 1x and 4x the data (64 and 256 MiB, in shards of
   4 MiB so that the stream's bound, about 2 windows + prefetch shards, is below 1x), each in
   a fresh process: the peak is reset after the imports (/proc/self/clear_refs), VmRSS is the
   baseline, VmHWM after the epoch the peak. Data memory = peak - baseline; its growth from
   1x to 4x should be about 1 for the stream, and about 4 for the in-memory path (shown for
   contrast: `load_split` of a train.pt, which reads the file's bytes before torch.load, so
   its peak is about twice the split).
3. Formatting throughput (images/s) of `format_shards_on` on a LocalCluster of 1 worker
   against 2 (ddpflow's local_cluster: processes, 1 thread each), over a folder of random
   64x64 RGB PNGs in 10 classes (--images, --png-size), into a fresh artifact store each
   time (nothing reused), image_size 64, chunks of 1 MiB (--format-shard-mb: enough chunks
   for 2 workers to share); best of 3 runs. Cluster start and the workers' first imports
   (torchvision) are outside the timer: a flow pays them once, not per image. For reference,
   sequential `format_shards` in this process (no Dask) shows what the decoding costs alone.

Nothing here is a timed test; on a shared machine, compare ratios, not absolute figures.
`--record` writes the entries streaming_throughput, streaming_memory and streaming_format of
results/latest.json (the file's other entries are kept).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from bench.common import (
    BENCH_THREADS,
    Result,
    command_line,
    load_average,
    print_results,
    record_entry,
)
from ddpflow import storage
from ddpflow.shards.index import ShardIndex, read_index, write_index, write_records
from ddpflow.shards.shard_file import ShardInfo
from ddpflow.shards.stream import ShardStream
from ddpflow.training.batching import epoch_batches
from ddpflow.training.samples import Samples
from ddpflow.workloads.vision.data import ImageSplit, load_split

REPO = Path(__file__).resolve().parents[1]
BATCH_SIZE = 64
SEED = 0
EPOCHS = 2  # the first may pay page-cache misses (and, on S3, new connections)
NUM_CLASSES = 10
BUCKET = "ddpflow-bench"
MiB = 2**20


@dataclass(frozen=True)
class Sizes:
    """What one run measures, from the command line (and --quick)."""

    image_size: int
    window: int
    prefetch: int
    data_mb: float
    shard_mb: float
    rss_mb: float
    rss_shard_mb: float
    images: int
    format_shard_mb: float
    format_repeats: int
    png_size: int

    @property
    def record_shape(self) -> tuple[int, int, int]:
        return (3, self.image_size, self.image_size)

    @property
    def record_bytes(self) -> int:
        return 3 * self.image_size * self.image_size


# --- data ------------------------------------------------------------------------------------


def synthetic(num_samples: int, shape: tuple[int, ...], seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Random uint8 records and labels: their content does not matter to any path here."""
    rng = np.random.default_rng(seed)
    images = rng.integers(0, 256, (num_samples, *shape), dtype=np.uint8)
    labels = rng.integers(0, NUM_CLASSES, num_samples, dtype=np.int64)
    return images, labels


def samples_for(megabytes: float, record_bytes: int, shard_mb: float) -> int:
    """About `megabytes` of records, in whole shards of about `shard_mb` (no tiny last one)."""
    per_shard = records_per_shard(shard_mb, record_bytes)
    num = int(megabytes * MiB // record_bytes)
    return max(BATCH_SIZE, per_shard * (num // per_shard) or num)


def records_per_shard(shard_mb: float, record_bytes: int) -> int:
    return max(1, int(shard_mb * MiB // record_bytes))


def write_split(
    index_uri: str, images: np.ndarray, labels: np.ndarray, shard_mb: float
) -> ShardIndex:
    """`images` as consecutive shards of about `shard_mb` next to `index_uri`, then the
    index (last, as formatting does). Shard i holds the i-th run of records, in order."""
    per_shard = records_per_shard(shard_mb, images[0].nbytes)
    return write_records(index_uri, images, labels.tolist(), per_shard)


def sub_index(index_uri: str, index: ShardIndex, shards: tuple[ShardInfo, ...]) -> ShardIndex:
    """An index at `index_uri` over some of `index`'s shards (in the same shards folder)."""
    return write_index(index_uri, index.record_shape, shards)


def evict_page_cache(index: ShardIndex) -> None:
    """Drop the local shards' pages from the page cache, so the next read goes to the disk.
    (Clean pages only: storage.write_bytes fsyncs every shard it writes.)"""
    for shard in index.shards:
        fd = os.open(index.uri(shard), os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


# --- 1. delivered samples/s ------------------------------------------------------------------


def epoch_rate(data: Samples, epoch: int) -> float:
    """Samples/s of one rank's epoch into a no-op step, run as fit() runs it
    (ddpflow.training.loop): the epoch's order, the rank's batches, start_epoch, each batch."""
    started = time.perf_counter()
    batches = epoch_batches(
        len(data), BATCH_SIZE, 0, 1, SEED, epoch, order=getattr(data, "epoch_order", None)
    )
    if (start_epoch := getattr(data, "start_epoch", None)) is not None:
        start_epoch(epoch, batches)
    for index in batches:
        data.batch(index)  # the no-op step: the batch is made and dropped
    return len(data) / (time.perf_counter() - started)


@contextlib.contextmanager
def moto_s3(log_dir: Path) -> Iterator[str]:
    """A moto S3 server on 127.0.0.1 (its own process, as the integration tests start it),
    with this process's AWS variables pointing at it for the block (ddpflow.storage.s3_options
    reads AWS_ENDPOINT_URL_S3); the variables and s3fs's cached clients are restored after."""
    import s3fs

    from infra.services import FAKE_AWS, create_bucket, free_port, start_moto, stop

    service = start_moto(free_port(), log_dir)
    env = {
        **FAKE_AWS,
        "AWS_ENDPOINT_URL_S3": service.url,
        "AWS_EC2_METADATA_DISABLED": "true",  # no wait for an instance role
    }
    saved = {key: os.environ.get(key) for key in env}
    try:
        os.environ.update(env)
        s3fs.S3FileSystem.clear_instance_cache()
        create_bucket(service.url, BUCKET)
        yield f"s3://{BUCKET}"
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        s3fs.S3FileSystem.clear_instance_cache()
        stop(service)


def measure_throughput(sizes: Sizes, folder: Path) -> dict[str, Any]:
    """Each path's samples/s in each of EPOCHS epochs. The paths take turns within an epoch,
    so load that drifts during the run hits all three alike."""
    num = samples_for(sizes.data_mb, sizes.record_bytes, sizes.shard_mb)
    images, labels = synthetic(num, sizes.record_shape, SEED)
    found: dict[str, Any] = {"samples": num, "data_mib": images.nbytes / MiB}
    local = write_split(str(folder / "local" / "train.shards.json"), images, labels, sizes.shard_mb)
    found["shards"] = len(local.shards)
    with moto_s3(folder / "moto-logs") as bucket:
        index_uri = f"{bucket}/streaming/train.shards.json"
        started = time.perf_counter()
        write_split(index_uri, images, labels, sizes.shard_mb)
        found["s3_upload_mib_s"] = images.nbytes / MiB / (time.perf_counter() - started)
        paths: dict[str, Samples] = {
            "memory": ImageSplit(torch.from_numpy(images), torch.from_numpy(labels)),
            "local": ShardStream(local, sizes.window, sizes.prefetch),
            # Read back as a rank finds it: the index from the store, the shards beside it.
            "s3": ShardStream(read_index(index_uri), sizes.window, sizes.prefetch),
        }
        # The shards were just written, so they are in the page cache: without this, the
        # first local epoch would show memory, not the disk a rank reads a large split from.
        evict_page_cache(local)
        for key in paths:
            found[key] = []
        for epoch in range(EPOCHS):
            for key, data in paths.items():
                found[key].append(epoch_rate(data, epoch))
        for key in ("local", "s3"):
            stream = paths[key]
            assert isinstance(stream, ShardStream)
            found[f"{key}_peak_shards"] = stream.peak_shards
            stream.close()
    return found


def rates(values: list[float]) -> str:
    return ", ".join(f"{value:,.0f}" for value in values)


def throughput_results(found: dict[str, Any], sizes: Sizes) -> list[Result]:
    base = max(found["memory"])
    settings = (
        f"{found['samples']:,} records of {sizes.record_shape} ({found['data_mib']:.0f} MiB), "
        f"batch {BATCH_SIZE}, world_size 1, no-op step; {found['shards']} shards of "
        f"~{sizes.shard_mb:g} MiB, window {sizes.window}, prefetch {sizes.prefetch}; best of "
        f"{EPOCHS} epochs"
    )
    rows = []
    for key, figure, note in (
        ("local", "samples/s, shards on local disk", "epoch 1 after evicting the page cache"),
        ("s3", "samples/s, shards in moto S3 (HTTP)", "moto on 127.0.0.1, same machine"),
    ):
        rate = max(found[key])
        rows.append(
            Result(
                "streaming",
                figure,
                rate,
                base,
                "samples/s",
                rate / base,
                "streamed / in-memory (info)",
                None,
                f"{settings}; {note}; epochs: {rates(found[key])}; baseline: ImageSplit.batch in "
                f"memory, uniform order, epochs {rates(found['memory'])}",
            )
        )
    return rows


# --- 2. peak RSS -----------------------------------------------------------------------------


def _status(field: str) -> int:
    """A /proc/self/status memory field (VmRSS, VmHWM) in bytes."""
    with open("/proc/self/status", encoding="ascii") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def rss_child(kind: str, uri: str, window: int, prefetch: int) -> dict[str, Any]:
    """In a fresh process (python -c, see peak_rss): one rank's epoch over the split at
    `uri` ("stream": a shard index; "memory": a train.pt), its memory from /proc/self."""
    torch.set_num_threads(BENCH_THREADS)
    # Everything is imported (this module imports what both paths use): reset the peak to
    # the current RSS, which is then the baseline.
    with open("/proc/self/clear_refs", "w", encoding="ascii") as clear_refs:
        clear_refs.write("5")
    baseline = _status("VmRSS")
    if kind == "stream":
        stream = ShardStream(read_index(uri), window, prefetch)
        epoch_rate(stream, 0)
        extra = {
            "peak_shards": stream.peak_shards,
            "shard_mib": stream.index.nbytes / len(stream.index.shards) / MiB,
            "data_mib": stream.index.nbytes / MiB,
        }
        stream.close()
    else:
        split = load_split(uri)
        epoch_rate(split, 0)
        extra = {"data_mib": split.images.nbytes / MiB}
    return {"baseline": baseline, "peak": _status("VmHWM"), **extra}


def peak_rss(kind: str, uri: str, window: int, prefetch: int) -> dict[str, Any]:
    """rss_child in a new interpreter: nothing this process holds counts in its peak."""
    code = (
        "import json, sys\n"
        "from bench.streaming import rss_child\n"
        "print(json.dumps(rss_child(*json.loads(sys.argv[1]))))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, json.dumps([kind, uri, window, prefetch])],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(f"the {kind} memory child failed:\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def measure_memory(sizes: Sizes, folder: Path) -> dict[str, Any]:
    """Both sizes share the 4x split's shards: 1x is its first quarter (the same records)."""
    num = samples_for(4 * sizes.rss_mb, sizes.record_bytes, sizes.rss_shard_mb)
    images, labels = synthetic(num, sizes.record_shape, SEED + 1)
    full = write_split(str(folder / "x4.shards.json"), images, labels, sizes.rss_shard_mb)
    quarter = full.shards[: max(1, len(full.shards) // 4)]
    sub_index(str(folder / "x1.shards.json"), full, quarter)
    num_1x = sum(s.count for s in quarter)
    for name, n in (("x1", num_1x), ("x4", num)):
        pt = {"images": torch.from_numpy(images[:n]), "labels": torch.from_numpy(labels[:n])}
        storage.save_torch(str(folder / f"{name}.pt"), pt)
    del images, labels
    found: dict[str, Any] = {"shards_1x": len(quarter), "shards_4x": len(full.shards)}
    for kind, suffix in (("stream", ".shards.json"), ("memory", ".pt")):
        for name in ("x1", "x4"):
            found[f"{kind}_{name}"] = peak_rss(
                kind, str(folder / f"{name}{suffix}"), sizes.window, sizes.prefetch
            )
    return found


def data_mib(run: dict[str, Any]) -> float:
    return (run["peak"] - run["baseline"]) / MiB


def memory_results(found: dict[str, Any], sizes: Sizes) -> list[Result]:
    s1, s4 = found["stream_x1"], found["stream_x4"]
    m1, m4 = found["memory_x1"], found["memory_x4"]
    bound = (2 * sizes.window + sizes.prefetch) * sizes.rss_shard_mb
    return [
        Result(
            "streaming",
            "rank data memory, streamed, 4x vs 1x data",
            data_mib(s4),
            data_mib(s1),
            "MiB",
            data_mib(s4) / data_mib(s1),
            "growth 4x / 1x (info; bounded: ~1)",
            None,
            f"peak RSS - baseline after imports, one epoch, fresh process each; data "
            f"{s1['data_mib']:.0f} / {s4['data_mib']:.0f} MiB in {found['shards_1x']} / "
            f"{found['shards_4x']} shards of ~{sizes.rss_shard_mb:g} MiB, window "
            f"{sizes.window}, prefetch {sizes.prefetch} (~{bound:g} MiB bound); most shards "
            f"held {s1['peak_shards']} / {s4['peak_shards']}; baselines "
            f"{s1['baseline'] / MiB:.0f} / {s4['baseline'] / MiB:.0f} MiB",
        ),
        Result(
            "streaming",
            "rank data memory, in memory, 4x vs 1x data",
            data_mib(m4),
            data_mib(m1),
            "MiB",
            data_mib(m4) / data_mib(m1),
            "growth 4x / 1x (info; contrast)",
            None,
            f"load_split of a train.pt ({m1['data_mib']:.0f} / {m4['data_mib']:.0f} MiB of "
            "images): the file's bytes and the tensor are both held during torch.load; "
            f"baselines {m1['baseline'] / MiB:.0f} / {m4['baseline'] / MiB:.0f} MiB",
        ),
        Result(
            "streaming",
            "rank data memory at 4x, streamed vs in memory",
            data_mib(s4),
            data_mib(m4),
            "MiB",
            data_mib(s4) / data_mib(m4),
            "streamed / in-memory (info)",
            None,
        ),
    ]


# --- 3. formatting throughput ----------------------------------------------------------------


def write_png_folder(root: Path, count: int, size: int, seed: int) -> None:
    """`count` random RGB PNGs of size x size in NUM_CLASSES class folders (noise does not
    compress: each file is about 3 * size * size bytes, more than a photo's)."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    for i in range(count):
        label = i % NUM_CLASSES
        (root / str(label)).mkdir(parents=True, exist_ok=True)
        pixels = rng.integers(0, 256, (size, size, 3), dtype=np.uint8)
        buffer = io.BytesIO()
        Image.fromarray(pixels).save(buffer, format="PNG")
        (root / str(label) / f"{i:06d}.png").write_bytes(buffer.getvalue())


FORMAT_IMAGE_SIZE = 64  # the formatted records' side (ImageSpec.image_size)
VAL_FRACTION = 0.1
# A worker's (or this process's) first chunk would import torchvision, seconds on a busy
# machine: a flow pays that once per worker, not per image, so it is done before any timer.
WARM_IMPORTS = "import torchvision.transforms.v2, ddpflow.workloads.vision.shard_format"


def format_times(sizes: Sizes, root: Path, folder: Path, client: Any = None) -> dict[str, Any]:
    """Seconds of each of `format_repeats` formats of `root` (plan_shards outside the timer),
    on `client`'s workers (format_shards_on) or, without one, here one chunk after another
    (format_shards); each into a new artifact store, so no chunk record or shard is reused."""
    from ddpflow.workloads.vision.data import ImageSpec
    from ddpflow.workloads.vision.objects import DEFAULT_MAX_IMAGE_MB
    from ddpflow.workloads.vision.shard_format import format_shards, format_shards_on, plan_shards

    spec = ImageSpec(image_size=FORMAT_IMAGE_SIZE)
    times, chunks = [], 0
    for _ in range(sizes.format_repeats):
        store = tempfile.mkdtemp(prefix="store-", dir=folder)
        plan = plan_shards(
            str(root), store, spec, VAL_FRACTION, SEED, DEFAULT_MAX_IMAGE_MB, sizes.format_shard_mb
        )
        chunks = len(plan.chunks)
        started = time.perf_counter()
        if client is None:
            result = format_shards(plan, max_bad_fraction=0.0)
        else:
            result = format_shards_on(client, plan, max_bad_fraction=0.0)
        times.append(time.perf_counter() - started)
        if result.reused or result.num_train + result.num_val != sizes.images:
            raise RuntimeError(f"the format reused or lost images: {result}")
    return {"images_s": sizes.images / min(times), "times_s": times, "chunks": chunks}


def format_on_cluster(sizes: Sizes, root: Path, folder: Path, num_workers: int) -> dict[str, Any]:
    """format_times on a new local_cluster(num_workers), as a flow starts it."""
    import distributed

    from ddpflow.cluster.build import local_cluster

    with local_cluster(num_workers) as cluster, distributed.Client(cluster) as client:
        client.wait_for_workers(num_workers, timeout=120)
        client.run(exec, WARM_IMPORTS, {})
        return format_times(sizes, root, folder, client)


def measure_formatting(sizes: Sizes, folder: Path) -> dict[str, Any]:
    root = folder / "pngs"
    write_png_folder(root, sizes.images, sizes.png_size, SEED)
    exec(WARM_IMPORTS, {})
    # In this process, no Dask: what the decoding itself costs, to read the clusters' by.
    found = {"in_process": format_times(sizes, root, folder)}
    for num_workers in (1, 2):
        found[f"workers_{num_workers}"] = format_on_cluster(sizes, root, folder, num_workers)
    return found


def seconds(values: list[float]) -> str:
    return ", ".join(f"{value:.2f}" for value in values)


def format_results(found: dict[str, Any], sizes: Sizes) -> list[Result]:
    here, one, two = found["in_process"], found["workers_1"], found["workers_2"]
    setting = (
        f"{sizes.images} random {sizes.png_size}x{sizes.png_size} RGB PNGs, image_size "
        f"{FORMAT_IMAGE_SIZE}, {two['chunks']} chunks of ~{sizes.format_shard_mb:g} MiB, a "
        f"fresh store each run, best of {sizes.format_repeats}"
    )
    return [
        Result(
            "streaming",
            "format_shards_on images/s, 2 workers vs 1",
            two["images_s"],
            one["images_s"],
            "images/s",
            two["images_s"] / one["images_s"],
            "2 workers / 1 (info)",
            None,
            f"{setting}; runs (s) 1 worker {seconds(one['times_s'])}, 2 workers "
            f"{seconds(two['times_s'])}; cluster start and first imports outside the timer; "
            f"{os.cpu_count()} CPUs",
        ),
        Result(
            "streaming",
            "format_shards_on images/s, 1 worker vs in-process",
            one["images_s"],
            here["images_s"],
            "images/s",
            one["images_s"] / here["images_s"],
            "1 worker / format_shards here (info)",
            None,
            f"{setting}; the baseline is format_shards in this process, chunk after chunk, no "
            f"Dask: runs (s) {seconds(here['times_s'])}",
        ),
    ]


# --- command line ----------------------------------------------------------------------------


def parse(argv: list[str] | None) -> tuple[Sizes, bool, list[str]]:
    parser = command_line(
        "bench.streaming",
        __doc__,
        quick="smaller data (32 MiB; 16 / 64 MiB for memory), fewer images (600), "
        "best of 2 formatting runs instead of 3",
    )
    parser.add_argument("--image-size", type=int, default=64, help="record side, parts 1-2 (64)")
    parser.add_argument("--data-mb", type=float, help="throughput data, MiB (256; quick 32)")
    parser.add_argument("--shard-mb", type=float, help="throughput shard size, MiB (16; quick 4)")
    parser.add_argument("--window", type=int, default=4, help="stream window, shards (4)")
    parser.add_argument("--prefetch", type=int, default=2, help="stream prefetch, shards (2)")
    parser.add_argument("--rss-mb", type=float, help="memory test 1x data, MiB (64; quick 16)")
    parser.add_argument("--rss-shard-mb", type=float, help="memory test shards, MiB (4; quick 1)")
    parser.add_argument("--images", type=int, help="PNGs to format (2000; quick 600)")
    parser.add_argument(
        "--png-size", type=int, default=64, help="side of the PNGs to format (64; formatted to 64)"
    )
    parser.add_argument(
        "--format-shard-mb", type=float, help="formatting shard size, MiB (1; quick 0.5)"
    )
    parser.add_argument(
        "--only",
        nargs="+",
        choices=("throughput", "memory", "format"),
        default=["throughput", "memory", "format"],
        help="run only these parts",
    )
    parser.add_argument(
        "--record",
        action="store_true",
        help="also write entries streaming_throughput/_memory/_format of results/latest.json",
    )
    args = parser.parse_args(argv)
    quick = args.quick

    def pick(value: float | None, full: float, small: float) -> float:
        return value if value is not None else (small if quick else full)

    sizes = Sizes(
        image_size=args.image_size,
        window=args.window,
        prefetch=args.prefetch,
        data_mb=pick(args.data_mb, 256, 32),
        shard_mb=pick(args.shard_mb, 16, 4),
        rss_mb=pick(args.rss_mb, 64, 16),
        rss_shard_mb=pick(args.rss_shard_mb, 4, 1),
        images=int(pick(args.images, 2000, 600)),
        format_shard_mb=pick(args.format_shard_mb, 1, 0.5),
        format_repeats=2 if quick else 3,
        png_size=args.png_size,
    )
    return sizes, args.record, list(args.only)


def main(argv: list[str] | None = None) -> None:
    sizes, record, only = parse(argv)
    torch.set_num_threads(BENCH_THREADS)  # as a rank runs (bench.common)
    command = "python -m bench.streaming " + " ".join(sys.argv[1:] if argv is None else argv)
    summary: list[str] = []
    with tempfile.TemporaryDirectory(prefix="ddpflow-bench-streaming-") as tmp:
        folder = Path(tmp)
        if "throughput" in only:
            started, load_before = time.time(), load_average()
            found = measure_throughput(sizes, folder / "throughput")
            part = throughput_results(found, sizes)
            print_results("1. delivered samples/s to a no-op step (ratio to in-memory)", part)
            epochs = {key: rates(found[key]) for key in ("memory", "local", "s3")}
            print(
                f"each epoch (samples/s): in memory {epochs['memory']}; local {epochs['local']} "
                f"(epoch 1 from the disk); S3 {epochs['s3']}. Most shards held: local "
                f"{found['local_peak_shards']}, S3 {found['s3_peak_shards']}; S3 upload "
                f"{found['s3_upload_mib_s']:.0f} MiB/s"
            )
            base = max(found["memory"])
            summary.append(
                f"samples/s: in memory {base:,.0f}; local shards {max(found['local']):,.0f} "
                f"({max(found['local']) / base:.2f}x); S3 {max(found['s3']):,.0f} "
                f"({max(found['s3']) / base:.2f}x)"
            )
            if record:
                record_entry(
                    "streaming_throughput", command, load_before, part, started, measured=found
                )
        if "memory" in only:
            started, load_before = time.time(), load_average()
            found = measure_memory(sizes, folder / "memory")
            part = memory_results(found, sizes)
            print_results("2. a rank's data memory (peak RSS - baseline), 1x and 4x data", part)
            for key in ("stream_x1", "stream_x4", "memory_x1", "memory_x4"):
                run = found[key]
                print(
                    f"{key}: baseline {run['baseline'] / MiB:.0f} MiB, peak "
                    f"{run['peak'] / MiB:.0f} MiB, data {data_mib(run):.0f} MiB"
                )
            summary.append(
                f"data memory 1x -> 4x: streamed {data_mib(found['stream_x1']):.0f} -> "
                f"{data_mib(found['stream_x4']):.0f} MiB ({part[0].ratio:.2f}x); in memory "
                f"{data_mib(found['memory_x1']):.0f} -> {data_mib(found['memory_x4']):.0f} "
                f"MiB ({part[1].ratio:.2f}x)"
            )
            if record:
                record_entry(
                    "streaming_memory", command, load_before, part, started, measured=found
                )
        if "format" in only:
            started, load_before = time.time(), load_average()
            found = measure_formatting(sizes, folder / "format")
            part = format_results(found, sizes)
            print_results("3. format_shards_on images/s, 2 workers vs 1", part)
            summary.append(
                f"formatting: 1 worker {found['workers_1']['images_s']:,.0f} images/s, "
                f"2 workers {found['workers_2']['images_s']:,.0f} ({part[0].ratio:.2f}x); "
                f"in-process, no Dask {found['in_process']['images_s']:,.0f}"
            )
            if record:
                record_entry(
                    "streaming_format", command, load_before, part, started, measured=found
                )
    print("\n== summary ==")
    print("\n".join(summary))
    print(f"load average at the end: {', '.join(f'{v:.2f}' for v in load_average())}")


if __name__ == "__main__":
    main()
