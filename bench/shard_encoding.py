"""Raw against jpeg shards: bytes an image, images/s delivered, accuracy after the same epochs.

    .venv/bin/python -m bench.shard_encoding [--quick] [--quality Q] [--record]

A jpeg shard (ddpflow.shards.encoding) holds each formatted image compressed on its own; a
rank decodes the records its next batches take on `decode_threads` threads
(ddpflow.shards.decoding). This measures, each against raw shards in the same run:

1. Bytes an image at 64 and 224 px, on two generated folders: "shapes" (one of 4 shapes of
   a random size and colour, bright on a dark random colour gradient or dark on a bright
   one, with Gaussian pixel noise of 8 levels: photos are not flat; 400 images, PNG) and "digits"
   (scikit-learn's 8 x 8 scans, the flows' demo, 400 of them upscaled by the format step).
   Both are formatted through the flows' own format step (plan_shards / format_shards,
   resize crop) at quality Q (default 90; 75 and 95 are printed beside it): the figure is
   the shards' bytes (records, offsets table and labels) over the images. Target at 224 px:
   at most 1/4 of raw.
2. Images/s delivered to a no-op step (fit()'s way: the epoch's order, start_epoch, every
   batch of 64 made and dropped; one rank) from local shards of the shapes at 224 px (1,024
   images, --quick 256), raw against jpeg decoded by 1 and by 2 threads; best of 3 epochs,
   the streams taking turns. Torch runs one intra-op thread, as a rank does (bench.common).
3. Validation accuracy after the same epochs, raw against jpeg shards of the same folder,
   the same seeds (so the same order and batches: a jpeg format has the same chunks), on
   digits at 32 px (the flows' demo: 1,797 images, 3 epochs) and on shapes at 64 px (1,600
   images, 6 epochs): a ResNet-18 from scratch (ddpflow's ImageClassifier), Adam 1e-3,
   batch 32, no augmentation, 2 seeds each; the figure is the mean over the seeds, and the
   spread between seeds is the noise it is compared with. --quick: 1 seed, fewer images.

On a shared machine compare ratios, not absolute figures. `--record` writes entry
shard_encoding of results/latest.json (the file's other entries are kept).
"""

from __future__ import annotations

import io
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

from bench.common import (
    BENCH_THREADS,
    Result,
    command_line,
    load_average,
    print_results,
    record_entry,
)
from ddpflow.shards.encoding import RAW, ShardEncoding
from ddpflow.shards.index import read_index
from ddpflow.shards.stream import ShardStream
from ddpflow.training.batching import epoch_batches
from ddpflow.workloads.vision.data import FormattedImages, ImageSpec, open_split
from ddpflow.workloads.vision.digits import write_digits
from ddpflow.workloads.vision.model import build_resnet
from ddpflow.workloads.vision.shard_format import format_shards, plan_shards

SHAPES = ("circle", "square", "triangle", "cross")
NOISE = 8.0  # levels of Gaussian pixel noise on the shapes: a camera's, not a drawing's
QUALITIES = (75, 90, 95)
STEP_BATCH = 64
TRAIN_BATCH = 32


# --- data ------------------------------------------------------------------------------------


def shape_image(kind: str, rng: np.random.Generator, side: int = 256) -> Image.Image:
    """One `kind` in a random colour, size and place on a random two-colour gradient."""
    ramp = np.linspace(0, 1, side)[None, :, None]
    a, b = rng.integers(0, 256, 3), rng.integers(0, 256, 3)
    pixels = a + (b - a) * ramp * np.ones((side, 1, 1))
    ys, xs = np.mgrid[0:side, 0:side]
    r = rng.uniform(0.15, 0.35) * side
    cy, cx = rng.uniform(r, side - r, 2)
    dy, dx = ys - cy, xs - cx
    if kind == "circle":
        mask = dy**2 + dx**2 <= r**2
    elif kind == "square":
        mask = (abs(dy) <= r * 0.8) & (abs(dx) <= r * 0.8)
    elif kind == "triangle":
        mask = (dy <= r * 0.7) & (dy >= -r) & (abs(dx) <= (dy + r) * 0.6)
    else:
        mask = ((abs(dy) <= r * 0.25) | (abs(dx) <= r * 0.25)) & (abs(dy) <= r) & (abs(dx) <= r)
    # A random colour whose brightness is far from the background's: a shape as faint as its
    # background taught a small ResNet nothing in a few epochs (accuracy at chance), and one
    # that differs only in hue (the colour opposite a grey) is what JPEG's halved chroma
    # blurs first, where photos carry their shapes in brightness.
    dark_background = float(np.mean((a + b) / 2)) < 128
    pixels[mask] = rng.integers(170, 256, 3) if dark_background else rng.integers(0, 86, 3)
    pixels = pixels + rng.normal(0, NOISE, pixels.shape)
    return Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8))


def write_shapes(root: Path, count: int, seed: int = 0) -> str:
    """`count` shape PNGs, a quarter of each kind, as an image folder at `root`."""
    rng = np.random.default_rng(seed)
    for i in range(count):
        kind = SHAPES[i % len(SHAPES)]
        (root / kind).mkdir(parents=True, exist_ok=True)
        buffer = io.BytesIO()
        shape_image(kind, rng).save(buffer, format="PNG")
        (root / kind / f"{i:05d}.png").write_bytes(buffer.getvalue())
    return str(root)


def write_digits_folder(root: Path, count: int | None) -> str:
    """scikit-learn's digits as PNGs (the flows' demo), the first `count` of each class kept
    (None: all 1,797)."""
    folder = write_digits(str(root)).uri
    if count is not None:
        per_class = max(1, count // 10)
        for cls in sorted(Path(folder).iterdir()):
            for extra in sorted(cls.glob("*.png"))[per_class:]:
                extra.unlink()
    return folder


def formatted(
    folder: str, store: Path, size: int, encoding: ShardEncoding, shard_mb: float = 4.0
) -> FormattedImages:
    """The folder through the flows' format step (train 80 %, val 20 %, seed 0)."""
    plan = plan_shards(folder, str(store), ImageSpec(size), 0.2, 0, 20, shard_mb, encoding)
    return format_shards(plan, 0.0)


def bytes_per_image(data: FormattedImages) -> float:
    indexes = [read_index(data.train_uri), read_index(data.val_uri)]
    return sum(i.nbytes for i in indexes) / sum(len(i) for i in indexes)


# --- 1. bytes an image -----------------------------------------------------------------------


def measure_bytes(folders: dict[str, str], store: Path) -> dict[str, Any]:
    found: dict[str, Any] = {}
    for name, folder in folders.items():
        for size in (64, 224):
            row = {"raw": bytes_per_image(formatted(folder, store, size, RAW))}
            for quality in QUALITIES:
                jpeg = ShardEncoding("jpeg", quality)
                row[f"jpeg{quality}"] = bytes_per_image(formatted(folder, store, size, jpeg))
            found[f"{name}_{size}"] = row
    return found


def bytes_results(found: dict[str, Any], quality: int) -> list[Result]:
    results = []
    for key, row in found.items():
        name, size = key.rsplit("_", 1)
        ratio = row[f"jpeg{quality}"] / row["raw"]
        at_224 = size == "224"
        results.append(
            Result(
                benchmark="shard_encoding",
                figure=f"bytes/image, jpeg q{quality} vs raw, {name} {size} px",
                value=row[f"jpeg{quality}"],
                baseline=row["raw"],
                unit="B",
                ratio=ratio,
                target="jpeg/raw <= 0.25" if at_224 else "-",
                met=ratio <= 0.25 if at_224 else None,
                notes=", ".join(f"{k} {v:,.0f} B" for k, v in row.items()),
            )
        )
    return results


# --- 2. images/s delivered -------------------------------------------------------------------


def epoch_rate(data: ShardStream, epoch: int) -> float:
    """Images/s of one rank's epoch into a no-op step, run as fit() runs it."""
    started = time.perf_counter()
    batches = epoch_batches(len(data), STEP_BATCH, 0, 1, 0, epoch, order=data.epoch_order)
    data.start_epoch(epoch, batches)
    for index in batches:
        data.batch(index)
    return len(data) / (time.perf_counter() - started)


def measure_rate(folder: str, store: Path, quality: int, epochs: int) -> dict[str, list[float]]:
    raw = read_index(formatted(folder, store, 224, RAW, shard_mb=16).train_uri)
    jpeg = read_index(
        formatted(folder, store, 224, ShardEncoding("jpeg", quality), shard_mb=16).train_uri
    )
    streams = {
        "raw": ShardStream(raw),
        "jpeg_1_thread": ShardStream(jpeg, decode_threads=1),
        "jpeg_2_threads": ShardStream(jpeg, decode_threads=2),
    }
    found: dict[str, list[float]] = {key: [] for key in streams}
    for epoch in range(epochs):
        for key, stream in streams.items():
            found[key].append(epoch_rate(stream, epoch))
    for stream in streams.values():
        stream.close()
    return found


def rate_results(found: dict[str, list[float]], quality: int) -> list[Result]:
    base = max(found["raw"])
    one, two = max(found["jpeg_1_thread"]), max(found["jpeg_2_threads"])
    return [
        Result(
            benchmark="shard_encoding",
            figure=f"images/s to a no-op step, jpeg q{quality} 2 decode threads vs raw, 224 px",
            value=two,
            baseline=base,
            unit="img/s",
            ratio=two / base,
            target="-",
            met=None,
            notes=f"1 thread {one:,.0f} img/s ({one / base:.2f}x raw); 2 threads/1: "
            f"{two / one:.2f}x; local shards, 2 CPUs",
        ),
        Result(
            benchmark="shard_encoding",
            figure="images/s, jpeg 2 decode threads vs 1, 224 px",
            value=two,
            baseline=one,
            unit="img/s",
            ratio=two / one,
            target="2 threads/1 >= 1.5",
            met=two / one >= 1.5,
        ),
    ]


# --- 3. accuracy -----------------------------------------------------------------------------


def train_and_score(data: FormattedImages, epochs: int, seed: int) -> float:
    """Validation accuracy of a ResNet-18 trained `epochs` epochs on the split (one process,
    the stream's window order, as fit() deals it to one rank)."""
    torch.manual_seed(seed)
    train, val = open_split(data.train_uri), open_split(data.val_uri)
    model = build_resnet("resnet18", len(data.classes), "none", False)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    for epoch in range(epochs):
        model.train()
        order = getattr(train, "epoch_order", None)
        batches = epoch_batches(len(train), TRAIN_BATCH, 0, 1, seed, epoch, order=order)
        train.start_epoch(epoch, batches)  # type: ignore[attr-defined]
        for index in batches:
            images, labels = train.batch(index)
            _, loss = model(images, labels)
            assert loss is not None
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    model.eval()
    with torch.no_grad():
        images, labels = val.batch(torch.arange(len(val)))
        predicted = torch.cat([model(x)[0].argmax(1) for x in images.split(256)])
    return float((predicted == labels).float().mean())


def measure_accuracy(
    folders: dict[str, str], store: Path, quality: int, seeds: list[int], quick: bool
) -> dict[str, Any]:
    settings = {"digits": (32, 2 if quick else 3), "shapes": (64, 2 if quick else 6)}
    found: dict[str, Any] = {}
    for name, folder in folders.items():
        size, epochs = settings[name]
        for encoding in (RAW, ShardEncoding("jpeg", quality)):
            data = formatted(folder, store, size, encoding, shard_mb=0.25)
            started = time.perf_counter()
            scores = [train_and_score(data, epochs, seed) for seed in seeds]
            found[f"{name}_{encoding.kind}"] = {
                "accuracy": scores,
                "image_size": size,
                "epochs": epochs,
                "train_s": time.perf_counter() - started,
            }
    return found


def accuracy_results(found: dict[str, Any], quality: int) -> list[Result]:
    results = []
    for name in ("digits", "shapes"):
        raw, jpeg = found[f"{name}_raw"], found[f"{name}_jpeg"]
        mean_raw, mean_jpeg = statistics.mean(raw["accuracy"]), statistics.mean(jpeg["accuracy"])
        runs = raw["accuracy"] + jpeg["accuracy"]
        spread = max(runs) - min(runs)
        seeds_spread = max(max(a) - min(a) for a in (raw["accuracy"], jpeg["accuracy"]))
        # Within noise: the gap between the means is no more than the spread across training
        # seeds, or 2 points where one seed gives no spread.
        noise = max(seeds_spread, 0.02)
        results.append(
            Result(
                benchmark="shard_encoding",
                figure=f"val accuracy, jpeg q{quality} vs raw, {name} "
                f"{raw['image_size']} px, {raw['epochs']} epochs",
                value=100 * mean_jpeg,
                baseline=100 * mean_raw,
                unit="%",
                ratio=mean_jpeg / mean_raw,
                target="|jpeg - raw| <= seeds' spread (min 2 pp)",
                met=abs(mean_jpeg - mean_raw) <= noise,
                notes=f"raw {[round(100 * a, 1) for a in raw['accuracy']]}, jpeg "
                f"{[round(100 * a, 1) for a in jpeg['accuracy']]} (seeds); all runs within "
                f"{100 * spread:.1f} pp",
            )
        )
    return results


# --- main ------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> None:
    parser = command_line(
        "bench.shard_encoding",
        __doc__,
        quick="fewer images, one seed, fewer epochs (a check that it runs)",
        record="shard_encoding",
    )
    parser.add_argument("--quality", type=int, default=90, help="jpeg quality of the figures")
    args = parser.parse_args(argv)
    torch.set_num_threads(BENCH_THREADS)  # as a rank runs (bench.common)
    command = "python -m bench.shard_encoding " + " ".join(sys.argv[1:] if argv is None else argv)
    started, load_before = time.time(), load_average()
    quality, quick = args.quality, args.quick
    with tempfile.TemporaryDirectory(prefix="ddpflow-bench-encoding-") as tmp:
        root = Path(tmp)
        t0 = time.perf_counter()
        small = {
            "shapes": write_shapes(root / "shapes-400", 100 if quick else 400, seed=1),
            "digits": write_digits_folder(root / "digits-400", 100 if quick else 400),
        }
        found_bytes = measure_bytes(small, root / "store-bytes")
        part_bytes = bytes_results(found_bytes, quality)
        print_results("1. bytes an image, jpeg vs raw shards", part_bytes)

        rates_folder = write_shapes(root / "shapes-rate", 256 if quick else 1024, seed=2)
        found_rate = measure_rate(rates_folder, root / "store-rate", quality, 2 if quick else 3)
        part_rate = rate_results(found_rate, quality)
        print_results("2. images/s delivered to a no-op step, 224 px", part_rate)
        print({k: [round(v) for v in rates] for k, rates in found_rate.items()})

        training = {
            "digits": write_digits_folder(root / "digits-all", 400 if quick else None),
            "shapes": write_shapes(root / "shapes-train", 200 if quick else 1600, seed=3),
        }
        seeds = [0] if quick else [0, 1]
        found_acc = measure_accuracy(training, root / "store-acc", quality, seeds, quick)
        part_acc = accuracy_results(found_acc, quality)
        print_results("3. validation accuracy after the same epochs, jpeg vs raw", part_acc)
        print(f"took {time.perf_counter() - t0:.0f} s")
    results = part_bytes + part_rate + part_acc
    if args.record:
        measured = {"bytes": found_bytes, "images_s": found_rate, "accuracy": found_acc}
        record_entry("shard_encoding", command, load_before, results, started, measured=measured)


if __name__ == "__main__":
    main()
