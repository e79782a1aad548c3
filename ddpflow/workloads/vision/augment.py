"""Training-time augmentation of image batches: random resized crop and horizontal flip.

`augment_batch` takes a whole uint8 batch [B, 3, S, S] (as the formatted image tensors hold
them) and returns a batch of the same shape: each sample is cropped to a random box with
torchvision's `RandomResizedCrop` rules, resized back to S x S and flipped left-right with
probability 0.5, the parameters drawn for the whole batch at once.

Every sample's random parameters are a pure function of (seed, epoch, sample_id): they come
from a counter-based hash (splitmix64) of those three numbers and a draw index, never from a
random generator's state, nor from the batch the sample is in, its position there, the rank
or the world size. So a training resumed from a checkpoint repeats, epoch for epoch, the
augmentation the interrupted run would have applied; a run on 2 ranks and one on 8 augment
every sample identically (only the way samples are dealt out differs); and nothing here
touches torch's or numpy's global random state, which the training loop seeds separately
(dropout, shuffling).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
import torchvision.transforms.v2.functional as TF

from ddpflow.training.batching import uniform_order
from ddpflow.training.samples import Samples

# torchvision's RandomResizedCrop.get_params tries this many (area, ratio) draws before it
# falls back to a centre crop.
ATTEMPTS = 10

# The layout of each sample's stream of draws. Changing it changes the augmentation of every
# sample, so a run resumed with a changed layout would no longer repeat the original one.
_AREA = 0  # draws 0..9: area fraction of each attempt
_LOG_RATIO = ATTEMPTS  # draws 10..19: log aspect ratio of each attempt
_TOP = 2 * ATTEMPTS  # draw 20: top of the winning box
_LEFT = 2 * ATTEMPTS + 1  # draw 21: left of the winning box
_FLIP = 2 * ATTEMPTS + 2  # draw 22: horizontal flip
_DRAWS = 2 * ATTEMPTS + 3

# splitmix64 constants (Steele, Lea and Flood 2014; the golden-ratio increment and the
# finaliser multipliers of Java's SplittableRandom).
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MUL1 = np.uint64(0xBF58476D1CE4E5B9)
_MUL2 = np.uint64(0x94D049BB133111EB)
_MASK64 = (1 << 64) - 1


def _pair(name: str, value: object) -> tuple[float, float]:
    """Two finite real numbers as a tuple of floats, or ValueError naming the field."""
    ok = (
        isinstance(value, tuple | list)
        and len(value) == 2
        and all(
            isinstance(v, int | float | np.integer | np.floating) and not isinstance(v, bool)
            for v in value
        )
        and all(math.isfinite(float(v)) for v in value)
    )
    if not ok:
        raise ValueError(
            f"Augment.{name} must be a pair of finite numbers (low, high), got {value!r}"
        )
    assert isinstance(value, tuple | list)  # `ok` checked it; this tells the type checker
    return float(value[0]), float(value[1])


@dataclass(frozen=True)
class Augment:
    """Random resized crop (torchvision RandomResizedCrop semantics) and horizontal flip."""

    scale: tuple[float, float] = (0.08, 1.0)  # area fraction range of the crop
    ratio: tuple[float, float] = (3 / 4, 4 / 3)  # aspect ratio range, drawn log-uniform
    flip: bool = True  # flip with probability 0.5

    def __post_init__(self) -> None:
        scale = _pair("scale", self.scale)
        if not 0 < scale[0] <= scale[1] <= 1:
            raise ValueError(
                f"Augment.scale must satisfy 0 < low <= high <= 1 (fractions of the image's "
                f"area), got {self.scale!r}"
            )
        ratio = _pair("ratio", self.ratio)
        if not 0 < ratio[0] <= ratio[1]:
            raise ValueError(
                f"Augment.ratio must satisfy 0 < low <= high (width / height of the crop), "
                f"got {self.ratio!r}"
            )
        if not isinstance(self.flip, bool | np.bool_):
            raise ValueError(f"Augment.flip must be True or False, got {self.flip!r}")
        # Lists (from a JSON config) become tuples of floats, so equal settings compare and
        # hash equal.
        object.__setattr__(self, "scale", scale)
        object.__setattr__(self, "ratio", ratio)
        object.__setattr__(self, "flip", bool(self.flip))


def _mix(z: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser: a bijection of uint64 that scrambles every input bit into all
    output bits. uint64 array arithmetic wraps modulo 2**64 (what the hash needs), silently."""
    z = (z ^ (z >> np.uint64(30))) * _MUL1
    z = (z ^ (z >> np.uint64(27))) * _MUL2
    return z ^ (z >> np.uint64(31))


def _check_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer):
        raise ValueError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    return int(value)


def _check_ids(sample_ids: object, batch: int | None = None) -> torch.Tensor:
    if not isinstance(sample_ids, torch.Tensor):
        raise ValueError(
            f"sample_ids must be a 1-D int64 torch.Tensor, got {type(sample_ids).__name__}"
        )
    if sample_ids.dtype != torch.int64 or sample_ids.dim() != 1:
        raise ValueError(
            f"sample_ids must be a 1-D int64 tensor, got {sample_ids.dtype} of shape "
            f"{tuple(sample_ids.shape)}"
        )
    if batch is not None and sample_ids.shape[0] != batch:
        raise ValueError(
            f"sample_ids must have one id per image: {batch} images, "
            f"{sample_ids.shape[0]} sample_ids"
        )
    return sample_ids


def _uniforms(sample_ids: torch.Tensor, seed: int, epoch: int) -> np.ndarray:
    """float64 [B, _DRAWS] in [0, 1): draw j of sample i is a hash of (seed, epoch, id_i, j).

    Counter-based: no generator state, so a sample's draws do not depend on which other
    samples are hashed with it, and the global RNGs are never touched."""
    # Seeds and epochs count modulo 2**64 (negative ones as two's complement). One-element
    # arrays, not numpy scalars: scalar arithmetic warns on the wrap-around the hash relies on.
    seed_u = np.array([seed & _MASK64], dtype=np.uint64)
    epoch_u = np.array([epoch & _MASK64], dtype=np.uint64)
    ids = sample_ids.detach().cpu().numpy().astype(np.int64).view(np.uint64)
    # Chain the key through the bijective finaliser, one input at a time; the golden-ratio
    # increments keep an all-zero input away from the fixed point 0.
    key = _mix(seed_u + _GOLDEN)
    key = _mix((key ^ epoch_u) + _GOLDEN)
    key = _mix((key ^ ids) + _GOLDEN)  # [B]
    counters = (np.arange(1, _DRAWS + 1, dtype=np.uint64) * _GOLDEN)[None, :]  # [1, D]
    bits = _mix(key[:, None] + counters)  # [B, D]
    # The top 53 bits as a double: uniform on the multiples of 2**-53 in [0, 1).
    return (bits >> np.uint64(11)).astype(np.float64) * (2.0**-53)


def _fallback_box(augment: Augment, height: int, width: int) -> tuple[int, int, int, int]:
    """torchvision's centre crop when no attempt fits: the whole image, its ratio clamped."""
    in_ratio = width / height
    if in_ratio < augment.ratio[0]:
        w, h = width, int(round(width / augment.ratio[0]))
    elif in_ratio > augment.ratio[1]:
        h, w = height, int(round(height * augment.ratio[1]))
    else:
        w, h = width, height
    return (height - h) // 2, (width - w) // 2, h, w


def _params(
    sample_ids: torch.Tensor, seed: int, epoch: int, augment: Augment, height: int, width: int
) -> tuple[np.ndarray, np.ndarray]:
    """(boxes int64 [B, 4] as top, left, h, w; flips bool [B])."""
    u = _uniforms(sample_ids, seed, epoch)
    area = float(height * width)
    # All ATTEMPTS draws at once for every sample, then the first valid one per sample: the
    # same box torchvision's loop returns, without a Python loop over samples or attempts.
    target = area * (
        augment.scale[0] + u[:, _AREA : _AREA + ATTEMPTS] * (augment.scale[1] - augment.scale[0])
    )
    lo, hi = math.log(augment.ratio[0]), math.log(augment.ratio[1])
    aspect = np.exp(lo + u[:, _LOG_RATIO : _LOG_RATIO + ATTEMPTS] * (hi - lo))
    # np.round rounds half to even, as Python's round() in torchvision does.
    ws = np.round(np.sqrt(target * aspect)).astype(np.int64)
    hs = np.round(np.sqrt(target / aspect)).astype(np.int64)
    valid = (ws > 0) & (ws <= width) & (hs > 0) & (hs <= height)  # [B, ATTEMPTS]
    first = valid.argmax(axis=1)  # the first True (0 where none; masked below)
    found = valid.any(axis=1)
    rows = np.arange(len(u))
    f_top, f_left, f_h, f_w = _fallback_box(augment, height, width)
    h = np.where(found, hs[rows, first], f_h)
    w = np.where(found, ws[rows, first], f_w)
    # Uniform over the height - h + 1 valid tops (torch.randint(0, height - h + 1)); the
    # minimum guards the product rounding up to the excluded bound.
    top = np.minimum(np.floor(u[:, _TOP] * (height - h + 1)).astype(np.int64), height - h)
    left = np.minimum(np.floor(u[:, _LEFT] * (width - w + 1)).astype(np.int64), width - w)
    top = np.where(found, top, f_top)
    left = np.where(found, left, f_left)
    boxes = np.stack([top, left, h, w], axis=1).astype(np.int64)
    flips = (u[:, _FLIP] < 0.5) & augment.flip
    return boxes, flips


def crop_boxes(
    sample_ids: torch.Tensor, seed: int, epoch: int, augment: Augment, height: int, width: int
) -> torch.Tensor:
    """int64 [B, 4]: each sample's crop box (top, left, h, w) in a height x width image, as
    `augment_batch` uses it."""
    _check_ids(sample_ids)
    seed, epoch = _check_int("seed", seed), _check_int("epoch", epoch)
    height, width = _check_int("height", height), _check_int("width", width)
    if height < 1 or width < 1:
        raise ValueError(f"height and width must be positive, got {height} x {width}")
    boxes, _ = _params(sample_ids, seed, epoch, augment, height, width)
    return torch.from_numpy(boxes)


def flip_mask(sample_ids: torch.Tensor, seed: int, epoch: int, augment: Augment) -> torch.Tensor:
    """bool [B]: which samples `augment_batch` flips (none when augment.flip is False)."""
    _check_ids(sample_ids)
    seed, epoch = _check_int("seed", seed), _check_int("epoch", epoch)
    _, flips = _params(sample_ids, seed, epoch, augment, 1, 1)
    return torch.from_numpy(flips)


def augment_batch(
    images: torch.Tensor, sample_ids: torch.Tensor, seed: int, epoch: int, augment: Augment
) -> torch.Tensor:
    """uint8 [B, 3, S, S] -> uint8 [B, 3, S, S] (same size: crop then resize back to S).

    Sample i's crop and flip depend only on (seed, epoch, sample_ids[i]): see `crop_boxes`
    and `flip_mask`. A non-square [B, 3, H, W] batch works too and keeps its H x W."""
    if not isinstance(images, torch.Tensor):
        raise ValueError(f"images must be a uint8 torch.Tensor, got {type(images).__name__}")
    if images.dtype != torch.uint8 or images.dim() != 4 or images.shape[1] != 3:
        raise ValueError(
            f"images must be a uint8 tensor [B, 3, S, S], got {images.dtype} of shape "
            f"{tuple(images.shape)}"
        )
    batch, _, height, width = images.shape
    if height < 1 or width < 1:
        raise ValueError(f"images must have at least one pixel, got shape {tuple(images.shape)}")
    _check_ids(sample_ids, batch)
    seed, epoch = _check_int("seed", seed), _check_int("epoch", epoch)
    if not isinstance(augment, Augment):
        raise ValueError(f"augment must be an Augment, got {type(augment).__name__}")

    boxes, flips = _params(sample_ids, seed, epoch, augment, height, width)
    # A per-sample loop of torchvision's resized_crop on the uint8 images, not one batched
    # float grid_sample: measured on one CPU thread for 64 images at 224 px, 26-41 ms
    # against 170-230 ms (the batched way converts the batch to float and back, and builds
    # a float grid as large as the batch). The parameters are still drawn for the whole
    # batch at once; only the resampling is per sample.
    out = torch.empty_like(images)
    for i, (top, left, h, w) in enumerate(boxes.tolist()):
        if h == height and w == width:
            sample = images[i]  # the whole image: copied exactly, no resampling
        else:
            sample = TF.resized_crop(images[i], top, left, h, w, [height, width], antialias=True)
        out[i] = sample.flip(-1) if flips[i] else sample
    return out


class AugmentedSamples:
    """Training samples whose every batch goes through augment_batch, seeded by (seed, the
    epoch fit() announces, sample index): a resume, or a run on another world size,
    augments each sample of an epoch as the uninterrupted run does. Validation data is
    never wrapped."""

    def __init__(self, samples: Samples, seed: int, augment: Augment | None = None) -> None:
        self.samples = samples
        self.seed = seed
        self.augment = augment or Augment()
        self.epoch = 0

    def __len__(self) -> int:
        return len(self.samples)

    def epoch_order(self, seed: int, epoch: int) -> torch.Tensor:
        """The wrapped samples' own order (a streamed split's shard windows), else uniform."""
        order = getattr(self.samples, "epoch_order", None)
        return order(seed, epoch) if order else uniform_order(len(self.samples), seed, epoch)

    def start_epoch(self, epoch: int, batches: list[torch.Tensor]) -> None:
        self.epoch = epoch
        if (start := getattr(self.samples, "start_epoch", None)) is not None:
            start(epoch, batches)

    def batch(self, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        images, labels = self.samples.batch(index)
        return augment_batch(images, index, self.seed, self.epoch, self.augment), labels
