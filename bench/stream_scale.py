"""A scale run anyone can repeat: a folder 4x larger than a rank's data budget, streamed by 2 ranks.

    .venv/bin/python -m bench.stream_scale [--budget-mb 32] [--image-size 64] [--epochs 1]
                                           [--shard-mb 4] [--record]

What it shows. `python -m flows.train_images --data-layout shards` claims that a rank's
memory does not grow with the dataset: the folder is formatted into shards by the cluster's
workers, and each rank streams its part of every epoch, holding a bounded number of shards
(docs/data.md). This run makes a folder whose formatted size (3 x S x S bytes an image) is at
least 4x a per-rank data budget (--budget-mb, 32 MiB: >= 128 MiB, about 11,000 images at
64 px), so that holding it in every rank would not fit the budget, and trains on it as a
user does, from S3, then shows how much each rank's process grew while it trained.

How.
1. A moto S3 server on 127.0.0.1 (its own process and temporary folder, stopped at the end,
   on an error too), as bench/streaming.py and the integration tests start it.
2. A learnable image folder is generated straight into the bucket,
   `s3://<bucket>/images/<class>/<i>.png`: 8 classes, each its own colour and stripe pattern,
   with per-image brightness and pixel noise (so PNGs barely compress and the classes take
   some learning), PNGs of S x S, uploaded by a pool of threads.
3. The flow runs as a subprocess, as a user runs it: `python -m flows.train_images --source
   s3://.../images --data-layout shards --shard-mb 4 --world-size 2 --batch-size 64 --augment
   true --pin-memory false ...` in a new project folder (cwd, as the integration tests'
   project_env: DDPFLOW_ARTIFACT_ROOT=s3://<bucket>/artifacts, MLflow in a SQLite file of the
   project, its own PREFECT_HOME, PYTHONPATH = the repository, every inherited PREFECT_*,
   MLFLOW_*, DASK_*, DDPFLOW_* and AWS_* variable dropped, moto's AWS variables set). It is
   a first run in that project: the flow seeds Prefect's and MLflow's databases from the
   installed templates itself.
4. Every 0.2 s this process reads the RSS of the flow's Dask worker processes: the flow's
   LocalCluster forks its workers from a multiprocessing forkserver (ddpflow.cluster.build),
   so they are the children of the flow's descendant whose command line runs
   `multiprocessing.forkserver` (the nannies live in the flow process itself). Every
   descendant seen is printed once with what it was taken for. Each rank runs in its
   worker's task thread, so a worker's RSS is its rank's; the flow names each rank's worker
   ("rank R of 2: worker ..., pid P"), and a rank whose pid was not sampled is reported so.

What is compared, and why this way. Each rank names its worker's pid ("rank R of 2: worker
..., pid P"), printed once the ranks' process group has formed, before any rank builds its
model or opens its data. A rank's *baseline* is the lowest RSS sampled in the 3 s before its
line (its imports and whatever its formatting chunks left are in it; its peak while
formatting is printed beside it), its *peak* the highest from that line to the end of the
training task (Prefect's "Task run 'train-ddp-...' - Finished"; the evaluation task that
follows also runs on a worker and is left out), its *rise* the peak minus the baseline.
The rise is mostly not data: the model, DDP's gradient buckets, Adam's state, a step's
activations and a validation batch of 256 are there whatever the data, and rank 0 also
encodes and uploads checkpoints and logs to MLflow. So it is printed against a *control*,
the same training without data in a fresh process (peak reset after the imports, as
bench/streaming.py does): ddpflow's build_resnet, DDP over a 1-rank gloo group, Adam, 3 steps
of random uint8 batches of the same shape, one no-grad batch of 256.
What data costs a rank is measured inside the run instead, where everything else is the
same: its RSS *growth* while it reads most of an epoch. Rank 0 logs train_loss to MLflow
every 5 steps, stamped with the wall time of the step (read back from the project's SQLite
store after the flow; the ranks step in lockstep). The window runs from the first logged
step at least 10 into the last epoch (the RSS ramps up over the first few steps: activations,
Adam's state, the stream's first window) to the last one logged in it; meanwhile the rank
reads that share of the epoch's steps times the formatted train split (every rank reads
every shard: each global batch is dealt out to all ranks). The growth is the least-squares
trend of the rank's RSS samples over the window times its length: the RSS swings by tens of
MiB from step to step (activations, the shards in use), so a difference of two peaks would
measure the swing (it is kept in the record too, `growth_peaks_mib`). A rank that kept what
it read would grow by about the data read; a stream holds a bounded window, so its growth
should stay within the budget (the `met` of the recorded rows). The window the stream holds
all along (about 8 shards plus 2 read ahead: 32-40 MiB with --shard-mb 4) is in the RSS
from the first steps on, so not in the growth: it is the stream's bound by design
(bench/streaming.py measures it); it is in the *rise in the steps*, the peak up to the
window's end (before validation and the epoch's checkpoint) minus the baseline, printed
beside the control. An epoch of fewer than 15 steps has no growth window.

Printed: the images, formatted MiB and budget; the flow's wall time and its phases (from the
times its lines arrived here), the format time, the epoch lines and the final val accuracy;
per rank its RSS when first seen, its peak while formatting, the baseline, the rise in the
steps and to the end of training, rise - control, the growth, the data read meanwhile and
whether the growth is within the budget. Exits non-zero, with the tail of
the flow's output, if the flow fails. On a shared 2-core machine the times move with the
load; the memory figures much less.
`--record` writes the `stream_scale` entry of results/latest.json (other entries are kept).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import io
import json
import math
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import psutil

from bench.common import (
    BENCH_THREADS,
    Result,
    command_line,
    load_average,
    print_results,
    record_entry,
)

REPO = Path(__file__).resolve().parents[1]
BUCKET = "ddpflow-stream-scale"
MiB = 2**20
NUM_CLASSES = 8
SEED = 0
WORLD_SIZE = 2
BATCH_SIZE = 64
EVAL_BATCH_SIZE = 256  # ImageTrainJob.eval_batch_size
ARCH = "resnet18"  # the flow's default
SAMPLE_EVERY_S = 0.2
BASELINE_WINDOW_S = 3.0
# The growth window starts this many steps into the epoch: in the first steps the rank's RSS
# ramps up (activations, Adam's state, the stream's first window), measured settled by ~6.
SETTLE_STEPS = 10
UPLOAD_THREADS = 16  # moto answers one PUT in a few ms; threads hide the round trips
# Well-separated colours (RGB): a random resized crop keeps a class's colour, not its layout.
PALETTE = (
    (200, 40, 40),
    (40, 170, 40),
    (40, 60, 200),
    (210, 200, 40),
    (190, 40, 190),
    (40, 190, 190),
    (225, 225, 225),
    (70, 70, 70),
)
# The flow's lines this reads (ddpflow.distributed.launcher, ddpflow.training.fit_progress,
# flows/train_images.py, Prefect's task-run end).
RANK_LINE = re.compile(r"rank (\d+) of (\d+): worker \S+, pid (\d+)")
EPOCH_DONE = re.compile(r"epoch (\d+)/(\d+) done: .*?([\d,]+) samples/s, ([\d.]+) s")
TRAIN_DONE = re.compile(r"Task run 'train-ddp-\w+' - Finished in state")
VAL_ACCURACY = re.compile(r"val accuracy\s+([\d.]+)% of (\d+) images")
FORMATTING = re.compile(r"images: formatting (\d+) chunk\(s\) into shards")
RUN_ID = re.compile(r"MLflow run id\s+([0-9a-f]{32})")
FORMATTED = re.compile(r"images: (\d+) classes, (\d+) train / (\d+) validation")


# --- 1. moto S3 ------------------------------------------------------------------------------


@contextlib.contextmanager
def moto_s3(log_dir: Path) -> Iterator[dict[str, str]]:
    """A moto S3 server on 127.0.0.1 with BUCKET made; yields the AWS variables that point
    ddpflow (storage.s3_options reads AWS_ENDPOINT_URL_S3) and boto3 at it. Stopped on exit,
    an exception included."""
    from infra.services import FAKE_AWS, create_bucket, free_port, start_moto, stop

    service = start_moto(free_port(), log_dir)
    try:
        create_bucket(service.url, BUCKET)
        yield {
            **FAKE_AWS,
            "AWS_ENDPOINT_URL_S3": service.url,
            "AWS_EC2_METADATA_DISABLED": "true",  # no wait for an instance role
        }
    finally:
        stop(service)


# --- 2. the image folder ---------------------------------------------------------------------


def images_for(budget_mb: float, image_size: int) -> int:
    """The fewest images, a multiple of NUM_CLASSES, whose formatted size is >= 4x the budget."""
    per_image = 3 * image_size * image_size
    needed = math.ceil(4 * budget_mb * MiB / per_image)
    return NUM_CLASSES * math.ceil(needed / NUM_CLASSES)


def class_image(label: int, index: int, size: int) -> bytes:
    """Image `index` of class `label` as PNG bytes: the class's colour and stripes (horizontal
    for even classes, vertical for odd, a period per class), a per-image brightness shift
    and pixel noise. Seeded by (SEED, label, index): every run makes the same folder."""
    from PIL import Image

    rng = np.random.default_rng([SEED, label, index])
    period = 4 + 2 * (label // 2)
    axis = np.arange(size, dtype=np.float32)
    stripes = 30.0 * np.sin(2 * np.pi * (axis + rng.uniform(0, period)) / period)
    pattern = stripes[:, None] if label % 2 == 0 else stripes[None, :]
    pixels = (
        np.asarray(PALETTE[label], np.float32)[None, None, :]
        + pattern[..., None]
        + rng.uniform(-30, 30)
        + rng.normal(0, 25, (size, size, 3))
    )
    buffer = io.BytesIO()
    Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8)).save(buffer, format="PNG")
    return buffer.getvalue()


def upload_folder(aws: dict[str, str], count: int, size: int) -> dict[str, Any]:
    """`count` images into s3://BUCKET/images/<class>/<i>.png, made and PUT by a thread pool
    (one boto3 client: its methods are thread-safe); progress every 10 %."""
    import boto3
    from botocore.config import Config

    client = boto3.client(
        "s3",
        endpoint_url=aws["AWS_ENDPOINT_URL_S3"],
        aws_access_key_id=aws["AWS_ACCESS_KEY_ID"],
        aws_secret_access_key=aws["AWS_SECRET_ACCESS_KEY"],
        region_name=aws["AWS_DEFAULT_REGION"],
        config=Config(max_pool_connections=UPLOAD_THREADS),
    )

    def put(i: int) -> int:
        label = i % NUM_CLASSES
        body = class_image(label, i, size)
        client.put_object(Bucket=BUCKET, Key=f"images/{label}/{i:06d}.png", Body=body)
        return len(body)

    started, total, done = time.perf_counter(), 0, 0
    step = max(1, count // 10)
    with concurrent.futures.ThreadPoolExecutor(UPLOAD_THREADS) as pool:
        for nbytes in pool.map(put, range(count)):
            total += nbytes
            done += 1
            if done % step == 0 or done == count:
                print(
                    f"  uploaded {done:,}/{count:,} images ({total / MiB:.0f} MiB of PNG), "
                    f"{time.perf_counter() - started:.1f} s",
                    flush=True,
                )
    return {"png_mib": total / MiB, "upload_s": time.perf_counter() - started}


# --- 3./4. the flow and its workers' memory --------------------------------------------------


def flow_env(project: Path, aws: dict[str, str]) -> dict[str, str]:
    """A user's fresh project (tests/helpers/projects.py project_env, without copying the
    databases in: the flow seeds them from the installed templates on a first run)."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("PREFECT_", "MLFLOW_", "DASK_", "DDPFLOW_", "AWS_"))
    }
    env.update(aws)
    env.update(
        {
            "DDPFLOW_ARTIFACT_ROOT": f"s3://{BUCKET}/artifacts",
            "MLFLOW_TRACKING_URI": f"sqlite:///{project / 'mlflow.db'}",
            "PREFECT_HOME": str(project / ".prefect"),
            "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
            # A first start on a loaded machine can pass the ephemeral API's default 20 s.
            "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "120",
            "PYTHONPATH": str(REPO),
            # Lines arrive as they are printed: their arrival times date the flow's phases.
            "PYTHONUNBUFFERED": "1",
        }
    )
    return env


def flow_argv(args: Any) -> list[str]:
    return [
        sys.executable,
        "-m",
        "flows.train_images",
        "--source",
        f"s3://{BUCKET}/images",
        "--data-layout",
        "shards",
        "--shard-mb",
        f"{args.shard_mb:g}",
        "--image-size",
        str(args.image_size),
        "--epochs",
        str(args.epochs),
        "--world-size",
        str(WORLD_SIZE),
        "--batch-size",
        str(BATCH_SIZE),
        "--augment",
        "true",
        "--pin-memory",
        "false",
    ]


@dataclass
class Worker:
    """One Dask worker process of the flow: its RSS samples (monotonic s, bytes)."""

    pid: int
    samples: list[tuple[float, int]] = field(default_factory=list)

    def peak(self, start: float = float("-inf"), end: float = float("inf")) -> int | None:
        inside = [rss for t, rss in self.samples if start <= t <= end]
        return max(inside) if inside else None

    def trend(self, start: float, end: float) -> float | None:
        """The least-squares slope of the RSS over [start, end] times its length, in bytes."""
        inside = [(t, rss) for t, rss in self.samples if start <= t <= end]
        if len(inside) < 2:
            return None
        times, values = np.array(inside, dtype=np.float64).T
        return float(np.polyfit(times, values, 1)[0]) * (end - start)

    def lowest(self, start: float, end: float) -> int | None:
        inside = [rss for t, rss in self.samples if start <= t <= end]
        return min(inside) if inside else None


class Sampler(threading.Thread):
    """Every SAMPLE_EVERY_S, the RSS of each Dask worker under the flow process (see the
    docstring: the children of its multiprocessing forkserver)."""

    def __init__(self, flow_pid: int):
        super().__init__(name="rss-sampler", daemon=True)
        self.flow = psutil.Process(flow_pid)
        self.workers: dict[int, Worker] = {}
        self.seen: dict[int, str] = {}  # every descendant: what it was taken for
        self.stop_event = threading.Event()

    def run(self) -> None:
        while not self.stop_event.is_set():
            self.sample()
            self.stop_event.wait(SAMPLE_EVERY_S)

    def sample(self) -> None:
        now = time.monotonic()
        try:
            descendants = self.flow.children(recursive=True)
        except psutil.Error:
            return  # the flow has exited
        forkservers = {p.pid for p in descendants if "multiprocessing.forkserver" in _cmd(p)}
        for proc in descendants:
            try:
                is_worker = proc.ppid() in forkservers
                if proc.pid not in self.seen:
                    self.note(proc, is_worker, proc.pid in forkservers)
                if is_worker:
                    rss = proc.memory_info().rss
                    self.workers.setdefault(proc.pid, Worker(proc.pid)).samples.append((now, rss))
            except psutil.Error:
                continue  # it exited between the listing and the read

    def note(self, proc: psutil.Process, is_worker: bool, is_forkserver: bool) -> None:
        role = "dask worker" if is_worker else "forkserver" if is_forkserver else "other"
        self.seen[proc.pid] = role
        print(f"  [sampler] pid {proc.pid} ({role}): {_cmd(proc)[:110]}", flush=True)


def _cmd(proc: psutil.Process) -> str:
    try:
        return " ".join(proc.cmdline())
    except psutil.Error:
        return ""


@dataclass
class FlowRun:
    returncode: int
    wall_s: float
    lines: list[tuple[float, str]]  # (monotonic arrival time, line)
    started: float  # monotonic
    started_wall: float  # time.time() at the same moment
    workers: dict[int, Worker]
    seen: dict[int, str]

    @property
    def output(self) -> str:
        return "\n".join(line for _, line in self.lines)

    def first(self, pattern: re.Pattern[str]) -> tuple[float, re.Match[str]] | None:
        for t, line in self.lines:
            if match := pattern.search(line):
                return t, match
        return None

    def all(self, pattern: re.Pattern[str]) -> list[tuple[float, re.Match[str]]]:
        return [(t, m) for t, line in self.lines if (m := pattern.search(line))]


def run_flow(argv: list[str], env: dict[str, str], project: Path, timeout_s: float) -> FlowRun:
    """The flow as a subprocess in its own session (so that a timeout or Ctrl-C here stops
    it and everything it started), its output echoed and timestamped, its workers sampled."""
    project.mkdir(parents=True, exist_ok=True)
    started, started_wall = time.monotonic(), time.time()
    process = subprocess.Popen(
        argv,
        cwd=project,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        bufsize=1,
        start_new_session=True,
    )
    sampler = Sampler(process.pid)
    sampler.start()
    lines: list[tuple[float, str]] = []
    timer = threading.Timer(timeout_s, _stop_group, (process,))
    timer.start()
    try:
        assert process.stdout is not None
        for line in process.stdout:
            lines.append((time.monotonic(), line.rstrip("\n")))
            print(f"  | {line}", end="", flush=True)
        process.wait()
    except BaseException:
        _stop_group(process)
        raise
    finally:
        timer.cancel()
        sampler.stop_event.set()
        sampler.join()
    return FlowRun(
        process.returncode,
        time.monotonic() - started,
        lines,
        started,
        started_wall,
        sampler.workers,
        sampler.seen,
    )


def _stop_group(process: subprocess.Popen[str]) -> None:
    """SIGTERM to the flow's session (it stops its cluster and API), SIGKILL after 30 s."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)


# --- the control: what training needs without any data ---------------------------------------


def step_memory_child(image_size: int, num_classes: int) -> dict[str, int]:
    """In a fresh process (python -c, see step_memory): what a rank's training takes without
    any data. The peak is reset after the imports (/proc/self/clear_refs) and VmRSS is then
    the baseline; VmHWM after 3 training steps and one evaluation batch is the peak."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from ddpflow.workloads.vision.model import build_resnet
    from ddpflow.workloads.vision.training import make_optimizer

    torch.set_num_threads(BENCH_THREADS)  # as a rank runs
    with open("/proc/self/clear_refs", "w", encoding="ascii") as clear_refs:
        clear_refs.write("5")
    baseline = _status("VmRSS")
    # A 1-rank gloo group: DDP allocates its gradient buckets as in a rank of the flow.
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        torch.manual_seed(SEED)
        model = build_resnet(ARCH, num_classes)
        ddp = DistributedDataParallel(model)
        optimizer = make_optimizer("adam", list(model.parameters()), 0.002)
        shape = (3, image_size, image_size)
        for _ in range(3):
            images = torch.randint(0, 256, (BATCH_SIZE, *shape), dtype=torch.uint8)
            labels = torch.randint(0, num_classes, (BATCH_SIZE,))
            optimizer.zero_grad(set_to_none=True)
            _, loss = ddp(images, labels)
            loss.backward()
            optimizer.step()
        model.eval()
        with torch.no_grad():
            model(torch.randint(0, 256, (EVAL_BATCH_SIZE, *shape), dtype=torch.uint8))
    finally:
        dist.destroy_process_group()
    return {"baseline": baseline, "peak": _status("VmHWM")}


def _status(key: str) -> int:
    """A /proc/self/status memory field (VmRSS, VmHWM) in bytes."""
    with open("/proc/self/status", encoding="ascii") as status:
        for line in status:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {key}")


def step_memory(image_size: int, num_classes: int) -> dict[str, float]:
    """step_memory_child in a new interpreter: its rise (MiB) above its baseline."""
    code = (
        "import json, sys\n"
        "from bench.stream_scale import step_memory_child\n"
        "print(json.dumps(step_memory_child(*json.loads(sys.argv[1]))))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, json.dumps([image_size, num_classes])],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(f"the control process failed:\n{done.stderr[-4000:]}")
    found = json.loads(done.stdout.strip().splitlines()[-1])
    return {
        "rise_mib": (found["peak"] - found["baseline"]) / MiB,
        "baseline_mib": found["baseline"] / MiB,
    }


# --- figures ---------------------------------------------------------------------------------


def analyse(
    run: FlowRun, image_size: int, num_epochs: int, steps: list[tuple[int, float]]
) -> dict[str, Any]:
    """The flow's phases from its lines' arrival times (s after its start), and each rank's
    memory (rank_memory)."""
    found: dict[str, Any] = {"wall_s": run.wall_s}

    def rel(t: float) -> float:
        return t - run.started

    formatting, formatted = run.first(FORMATTING), run.first(FORMATTED)
    ranks = run.all(RANK_LINE)
    train_done = run.first(TRAIN_DONE)
    epoch_lines = run.all(EPOCH_DONE)
    if formatting:
        found["chunks"] = int(formatting[1].group(1))
        found["format_start_s"] = rel(formatting[0])
    if formatted:
        found["num_train"] = int(formatted[1].group(2))
        found["num_val"] = int(formatted[1].group(3))
        found["train_mib"] = found["num_train"] * 3 * image_size**2 / MiB
        found["formatted_s"] = rel(formatted[0])
        if formatting:
            found["format_s"] = formatted[0] - formatting[0]
    if ranks:
        found["training_start_s"] = rel(ranks[0][0])
    if train_done:
        found["training_end_s"] = rel(train_done[0])
    found["epochs"] = [
        {
            "epoch": int(m.group(1)),
            "samples_s": float(m.group(3).replace(",", "")),
            "epoch_s": float(m.group(4)),
            "line": m.group(0),
        }
        for _, m in epoch_lines
    ]
    if accuracy := run.first(VAL_ACCURACY):
        found["val_accuracy"] = float(accuracy[1].group(1)) / 100
        found["val_images"] = int(accuracy[1].group(2))
    end = train_done[0] if train_done else run.started + run.wall_s
    window = None
    if "num_train" in found:
        # fit() deals out every sample once an epoch in global batches (the last one short).
        per_epoch = math.ceil(found["num_train"] / (BATCH_SIZE * WORLD_SIZE))
        window = epoch_window(run, steps, num_epochs, per_epoch)
    found["growth_window"] = (
        None
        if window is None
        else {"from_s": rel(window[0]), "to_s": rel(window[1]), "percent": window[2]}
    )
    found["ranks"] = [
        rank_memory(run, int(m.group(1)), int(m.group(3)), t, end, window, found.get("train_mib"))
        for t, m in sorted(ranks, key=lambda item: int(item[1].group(1)))
    ]
    # Any other forkserver child (a short-lived one was seen at the start): listed, not used.
    found["other_workers"] = [
        {"pid": pid, "peak_mib": (w.peak() or 0) / MiB, "seen_s": len(w.samples) * SAMPLE_EVERY_S}
        for pid, w in run.workers.items()
        if pid not in {r["pid"] for r in found["ranks"]}
    ]
    return found


def step_times(project: Path, output: str) -> list[tuple[int, float]]:
    """(global step, wall time in s) of each train_loss rank 0 logged to the project's MLflow
    store (every 5 steps, ImageTrainJob.log_every_steps; stamped when logged, not when
    MLflow took it: ddpflow.tracking.loggers). The run is the one the flow's summary names."""
    from mlflow.tracking import MlflowClient

    match = RUN_ID.search(output)
    if match is None:
        return []
    client = MlflowClient(f"sqlite:///{project / 'mlflow.db'}")
    history = client.get_metric_history(match.group(1), "train_loss")
    return sorted((m.step, m.timestamp / 1000) for m in history)


def epoch_window(
    run: FlowRun, steps: list[tuple[int, float]], epochs: int, steps_per_epoch: int
) -> tuple[float, float, float] | None:
    """(start, end, share of the epoch's steps in between, in %) of the last epoch's training
    steps, from rank 0's logged steps (step_times): from the first logged step at least
    SETTLE_STEPS into the epoch to the last one logged in it. None with fewer than 2."""
    first = (epochs - 1) * steps_per_epoch
    inside = [(step - first, t) for step, t in steps if first + SETTLE_STEPS <= step]
    inside = [(step, t) for step, t in inside if step <= steps_per_epoch]
    if len(inside) < 2:
        return None
    (step_a, t_a), (step_b, t_b) = inside[0], inside[-1]
    # Wall times to this process's monotonic clock, on which the samples are taken.
    to_monotonic = run.started - run.started_wall
    return t_a + to_monotonic, t_b + to_monotonic, 100 * (step_b - step_a) / steps_per_epoch


def rank_memory(
    run: FlowRun,
    rank: int,
    pid: int,
    started: float,
    ended: float,
    window: tuple[float, float, float] | None,
    train_mib: float | None,
) -> dict[str, Any]:
    """One rank's worker (`pid`, named by the flow's "rank R of N: ..., pid P" line, which
    it prints at `started`; its training task finished at `ended`), in MiB: RSS when first
    seen, peak before training (formatting), baseline, peak in training, rise, and the growth
    over `window` against the data the rank read in it."""
    worker = run.workers.get(pid)
    row: dict[str, Any] = {"rank": rank, "pid": pid, "sampled": worker is not None}
    if worker is None:
        return row  # not among the forkserver's children: reported, not guessed
    baseline = worker.lowest(started - BASELINE_WINDOW_S, started)
    peak = worker.peak(started, ended)
    row.update(
        samples=len(worker.samples),
        first_mib=worker.samples[0][1] / MiB,
        peak_before_mib=(worker.peak(end=started) or 0) / MiB,
    )
    if baseline is None or peak is None:
        return row
    row.update(baseline_mib=baseline / MiB, peak_mib=peak / MiB, rise_mib=(peak - baseline) / MiB)
    if window is not None and train_mib is not None:
        t_a, t_b, percent = window
        before, during = worker.peak(started, t_a), worker.peak(t_a, t_b)
        trend = worker.trend(t_a, t_b)
        if before is not None and during is not None and trend is not None:
            row.update(
                growth_mib=trend / MiB,
                growth_peaks_mib=(during - before) / MiB,
                read_mib=train_mib * percent / 100,
                steps_peak_mib=max(before, during) / MiB,
                steps_rise_mib=(max(before, during) - baseline) / MiB,
            )
    return row


def results(found: dict[str, Any], budget_mb: float) -> list[Result]:
    """Per rank: the growth over the epoch against the data read meanwhile (met: within the
    budget), and the rise over training against the control (for information)."""
    rows = []
    control = found["control"]["rise_mib"]
    window = found["growth_window"]
    for rank in found["ranks"]:
        if "growth_mib" in rank:
            growth, read = rank["growth_mib"], rank["read_mib"]
            rank["within_budget"] = growth <= budget_mb
            rows.append(
                Result(
                    "stream_scale",
                    f"rank {rank['rank']}: RSS growth while reading {window['percent']:.0f} % "
                    "of the epoch",
                    growth,
                    read,
                    "MiB",
                    growth / read,
                    f"growth <= budget {budget_mb:g} MiB (baseline: data read meanwhile)",
                    growth <= budget_mb,
                    f"least-squares trend of the RSS {window['from_s']:.0f}-{window['to_s']:.0f} "
                    f"s after the flow's start (rank 0's logged steps); the peak in it minus "
                    f"the peak before: {rank['growth_peaks_mib']:.0f} MiB; holding what it read "
                    f"would add {read:.0f} MiB",
                )
            )
        if "rise_mib" in rank:
            rows.append(
                Result(
                    "stream_scale",
                    f"rank {rank['rank']}: RSS rise over training (peak - baseline)",
                    rank["rise_mib"],
                    control,
                    "MiB",
                    rank["rise_mib"] / control,
                    "rise / control, no data (info)",
                    None,
                    f"baseline {rank['baseline_mib']:.0f} MiB, peak {rank['peak_mib']:.0f} MiB; "
                    f"rise - control {rank['rise_mib'] - control:.0f} MiB; in the steps (to the "
                    f"window's end) {rank.get('steps_rise_mib', float('nan')):.0f} MiB; "
                    "the folder is "
                    f"{found['formatted_mib']:.0f} MiB formatted ({found['images']:,} images)",
                )
            )
    return rows


def report(found: dict[str, Any], args: Any) -> None:
    print("\n== the folder ==")
    times = found["formatted_mib"] / args.budget_mb
    print(
        f"{found['images']:,} images of {args.image_size} px in {NUM_CLASSES} classes: "
        f"{found['formatted_mib']:.1f} MiB formatted ({times:.1f}x the {args.budget_mb:g} MiB "
        f"budget), {found['png_mib']:.0f} MiB of PNG, uploaded in {found['upload_s']:.1f} s"
    )
    print("\n== the flow (s after its start, as its lines arrived here) ==")
    phases = [
        ("formatting started", "format_start_s"),
        ("formatted", "formatted_s"),
        ("training started (the ranks' lines)", "training_start_s"),
        ("training task finished", "training_end_s"),
        ("exited (wall time)", "wall_s"),
    ]
    for name, key in phases:
        if key in found:
            print(f"  {found[key]:7.1f}  {name}")
    if "format_s" in found:
        print(
            f"format: {found.get('chunks')} chunks in {found['format_s']:.1f} s "
            f"({found['images'] / found['format_s']:,.0f} images/s); "
            f"{found.get('num_train')} train / {found.get('num_val')} validation"
        )
    for epoch in found["epochs"]:
        print(f"  {epoch['line']}")
    if "val_accuracy" in found:
        print(f"val accuracy {found['val_accuracy']:.2%} of {found['val_images']} images")
    control = found["control"]
    print("\n== the ranks' memory (MiB) ==")
    print(
        f"control, the same model's training without data (fresh process, above its baseline "
        f"of {control['baseline_mib']:.0f}): {control['rise_mib']:.0f}"
    )
    window = found["growth_window"]
    if window:
        print(
            f"growth window: {window['from_s']:.0f}-{window['to_s']:.0f} s, "
            f"{window['percent']:.0f} % of the last epoch's steps"
        )
    print(
        "first: RSS when first seen; fmt: peak before training (formatting); base: baseline; "
        "steps: rise in the steps (to the window's end); rise: to the end of training "
        "(validation, rank 0's checkpoint); ctrl: rise - control; growth: the RSS trend over "
        "the growth window; read: what the rank read in it"
    )
    print(
        f"{'rank':>4} {'pid':>8} {'first':>6} {'fmt':>6} {'base':>6} {'steps':>6} {'rise':>6} "
        f"{'ctrl':>6} {'growth':>7} {'read':>6}  growth within {args.budget_mb:g}?"
    )
    for r in found["ranks"]:
        if "rise_mib" not in r:
            print(f"{r['rank']:>4} {r['pid']:>8}  (not sampled: {r})")
            continue
        growth = (
            f"{r['steps_rise_mib']:6.0f} {r['rise_mib']:6.0f} "
            f"{r['rise_mib'] - control['rise_mib']:6.0f} {r['growth_mib']:7.0f} "
            f"{r['read_mib']:6.0f}  {'yes' if r['within_budget'] else 'NO'}"
            if "growth_mib" in r
            else f"{'-':>6} {r['rise_mib']:6.0f} {r['rise_mib'] - control['rise_mib']:6.0f}"
            "  (no growth window)"
        )
        print(
            f"{r['rank']:>4} {r['pid']:>8} {r['first_mib']:6.0f} {r['peak_before_mib']:6.0f} "
            f"{r['baseline_mib']:6.0f} {growth}"
        )
    for other in found["other_workers"]:
        print(
            f"also a forkserver child, not a rank: pid {other['pid']}, peak "
            f"{other['peak_mib']:.0f} MiB, seen for about {other['seen_s']:.1f} s"
        )
    print(
        f"holding the folder would add {found['formatted_mib']:.0f} MiB to every rank "
        f"({found.get('train_mib', 0):.0f} MiB of it the train split)"
    )


def parse(argv: list[str] | None) -> Any:
    parser = command_line("bench.stream_scale", __doc__, record="stream_scale")
    parser.add_argument(
        "--budget-mb",
        type=float,
        default=32,
        help="per-rank data budget, MiB (32); the folder is at least 4x it, formatted",
    )
    parser.add_argument("--image-size", type=int, default=64, help="PNG and model side (64)")
    parser.add_argument("--epochs", type=int, default=1, help="epochs the flow trains (1)")
    parser.add_argument("--shard-mb", type=float, default=4, help="the flow's --shard-mb (4)")
    parser.add_argument(
        "--timeout-s", type=float, default=1800, help="stop the flow after this long (1800)"
    )
    parser.add_argument("--series", type=Path, help="also write every RSS sample and line here")
    return parser.parse_args(argv)


def write_series(path: Path, run: FlowRun) -> None:
    """Every worker's RSS samples and every line, in s after the flow's start (diagnosis)."""
    path.write_text(
        json.dumps(
            {
                "workers": {
                    str(pid): [(round(t - run.started, 2), rss) for t, rss in w.samples]
                    for pid, w in run.workers.items()
                },
                "lines": [(round(t - run.started, 2), line) for t, line in run.lines],
            }
        )
    )


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    command = "python -m bench.stream_scale " + " ".join(sys.argv[1:] if argv is None else argv)
    started, load_before = time.time(), load_average()
    count = images_for(args.budget_mb, args.image_size)
    found: dict[str, Any] = {
        "images": count,
        "formatted_mib": count * 3 * args.image_size**2 / MiB,
        "budget_mib": args.budget_mb,
        "shard_mb": args.shard_mb,
    }
    with tempfile.TemporaryDirectory(prefix="ddpflow-bench-stream-scale-") as tmp:
        folder = Path(tmp)
        with moto_s3(folder / "moto") as aws:
            print(
                f"generating {count:,} PNGs of {args.image_size} px into s3://{BUCKET}/images "
                f"({found['formatted_mib']:.1f} MiB formatted, budget {args.budget_mb:g} MiB)",
                flush=True,
            )
            found.update(upload_folder(aws, count, args.image_size))
            argv_flow = flow_argv(args)
            print("running:", " ".join(argv_flow[1:]), flush=True)
            project = folder / "project"
            run = run_flow(argv_flow, flow_env(project, aws), project, args.timeout_s)
        # Read while the project is there: the temporary folder goes at the end of the block.
        steps = step_times(project, run.output) if run.returncode == 0 else []
        if args.series:
            write_series(args.series, run)
        if run.returncode != 0:
            print(f"\nthe flow failed (exit {run.returncode}); its output's end:")
            print(run.output[-6000:])
            sys.exit(1)
    found.update(analyse(run, args.image_size, args.epochs, steps))
    found["descendants"] = {str(pid): role for pid, role in run.seen.items()}
    print("\nmeasuring the control (the model's training memory without data)...", flush=True)
    found["control"] = step_memory(args.image_size, NUM_CLASSES)
    rows = results(found, args.budget_mb)
    report(found, args)
    print_results("a rank's memory while it streams", rows)
    print(f"load average at the end: {', '.join(f'{v:.2f}' for v in load_average())}")
    if args.record:
        record_entry("stream_scale", command, load_before, rows, started, measured=found)


if __name__ == "__main__":
    main()
