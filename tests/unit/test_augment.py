"""ddpflow.workloads.vision.augment: per-sample augmentation that depends only on (seed, epoch,
sample_id), with torchvision's RandomResizedCrop rules, and no global RNG use."""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
import torch
from torchvision.transforms import RandomResizedCrop
from torchvision.transforms.v2 import functional as TF

from ddpflow.workloads.vision.augment import Augment, augment_batch, crop_boxes, flip_mask

SIZE = 24


def _images(n: int, size: int = SIZE, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n, 3, size, size), dtype=torch.uint8, generator=gen)


def test_a_sample_is_augmented_alike_in_any_batch_and_position() -> None:
    images = _images(64)
    ids = torch.arange(1000, 1064)
    full = augment_batch(images, ids, seed=7, epoch=3, augment=Augment())
    # A shuffled sub-batch (another rank's share, a resumed epoch's batch): rows follow ids.
    perm = torch.randperm(64, generator=torch.Generator().manual_seed(1))[:23]
    part = augment_batch(images[perm], ids[perm], seed=7, epoch=3, augment=Augment())
    assert torch.equal(part, full[perm])
    # One sample alone, too.
    alone = augment_batch(images[5:6], ids[5:6], seed=7, epoch=3, augment=Augment())
    assert torch.equal(alone[0], full[5])


def test_an_other_epoch_or_seed_changes_most_samples() -> None:
    images = _images(50)
    ids = torch.arange(50)
    base = augment_batch(images, ids, seed=1, epoch=0, augment=Augment())
    for other in (
        augment_batch(images, ids, seed=1, epoch=1, augment=Augment()),
        augment_batch(images, ids, seed=2, epoch=0, augment=Augment()),
    ):
        changed = (other != base).flatten(1).any(1).sum().item()
        assert changed >= 45, changed
    # And the same arguments give the same output (no hidden state between calls).
    assert torch.equal(augment_batch(images, ids, seed=1, epoch=0, augment=Augment()), base)


def test_no_crop_no_flip_is_the_exact_identity() -> None:
    images = _images(40, size=17)
    identity = Augment(scale=(1.0, 1.0), ratio=(1.0, 1.0), flip=False)
    out = augment_batch(images, torch.arange(40), seed=3, epoch=9, augment=identity)
    assert out.dtype == torch.uint8
    assert torch.equal(out, images)


def test_about_half_the_samples_are_flipped_exactly() -> None:
    images = _images(400, size=16)
    ids = torch.arange(400)
    no_crop = Augment(scale=(1.0, 1.0), ratio=(1.0, 1.0), flip=True)
    out = augment_batch(images, ids, seed=11, epoch=2, augment=no_crop)
    flipped = (out == images.flip(-1)).flatten(1).all(1)
    kept = (out == images).flatten(1).all(1)
    assert 150 <= int(flipped.sum()) <= 250
    assert bool((flipped | kept).all())  # every sample is one or the other, exactly
    assert torch.equal(flipped, flip_mask(ids, 11, 2, no_crop))


def test_crop_boxes_follow_the_scale_and_ratio_ranges_and_stay_inside() -> None:
    height, width = 32, 32
    augment = Augment(scale=(0.2, 0.6), ratio=(0.5, 2.0))
    boxes = crop_boxes(torch.arange(2000), 5, 0, augment, height, width)
    assert boxes.shape == (2000, 4) and boxes.dtype == torch.int64
    top, left, h, w = boxes.unbind(1)
    assert bool(((top >= 0) & (left >= 0) & (h >= 1) & (w >= 1)).all())
    assert bool(((top + h <= height) & (left + w <= width)).all())
    # w and h are rounded from sqrt(area * ratio) and sqrt(area / ratio): allow half a pixel.
    area = (h * w).double() / (height * width)
    area_lo = (h - 0.5).clamp(min=0) * (w - 0.5).clamp(min=0) / (height * width)
    area_hi = (h + 0.5) * (w + 0.5) / (height * width)
    assert bool(((area_hi >= 0.2) & (area_lo <= 0.6)).all())
    ratio_lo, ratio_hi = (w - 0.5) / (h + 0.5), (w + 0.5) / (h - 0.5)
    assert bool(((ratio_hi >= 0.5) & (ratio_lo <= 2.0)).all())
    # They spread over the range: not all the same size, not all in one corner.
    assert area.min() < 0.3 and area.max() > 0.5
    assert len(set(top.tolist())) > 10 and len(set(left.tolist())) > 10


def test_impossible_ranges_fall_back_to_torchvisions_centre_crop() -> None:
    # An aspect ratio of 4 to 5 with the whole area cannot fit a square image: the 10
    # attempts fail and torchvision crops the centre with the ratio clamped to the range.
    augment = Augment(scale=(1.0, 1.0), ratio=(4.0, 5.0))
    boxes = crop_boxes(torch.arange(10), 0, 0, augment, 20, 20)
    assert torch.equal(boxes, torch.tensor([[7, 0, 5, 20]] * 10))  # (top, left, h, w)
    with torch.random.fork_rng():
        want = RandomResizedCrop.get_params(torch.zeros(3, 20, 20), [1.0, 1.0], [4.0, 5.0])
    assert tuple(boxes[0].tolist()) == want
    # The other way round (too tall for the range): full height, width clamped.
    tall = crop_boxes(torch.arange(3), 0, 0, Augment(scale=(1.0, 1.0), ratio=(0.2, 0.25)), 20, 20)
    assert torch.equal(tall, torch.tensor([[0, 7, 20, 5]] * 3))


@pytest.mark.parametrize(
    "augment",
    # The second mixes crops of the whole image (copied exactly) with 15-pixel crops.
    [Augment(), Augment(scale=(0.9, 1.0), ratio=(1.0, 1.0))],
)
def test_resampling_matches_torchvision_resized_crop_and_flip(augment: Augment) -> None:
    images = _images(60)
    ids = torch.arange(60) * 17
    out = augment_batch(images, ids, 4, 1, augment)
    boxes = crop_boxes(ids, 4, 1, augment, SIZE, SIZE)
    flips = flip_mask(ids, 4, 1, augment)
    assert 0 < int(flips.sum()) < 60
    for i in range(60):
        top, left, h, w = boxes[i].tolist()
        want = TF.resized_crop(images[i], top, left, h, w, [SIZE, SIZE], antialias=False)
        if flips[i]:
            want = want.flip(-1)
        if (h, w) == (SIZE, SIZE):
            assert torch.equal(out[i], want), i
        else:
            # Float rounding of the sampling positions may move a value by one level.
            assert (want.int() - out[i].int()).abs().max() <= 1, i


def test_flip_setting_does_not_change_the_crops() -> None:
    ids = torch.arange(100)
    with_flip = crop_boxes(ids, 2, 2, Augment(flip=True), SIZE, SIZE)
    assert torch.equal(with_flip, crop_boxes(ids, 2, 2, Augment(flip=False), SIZE, SIZE))
    assert not bool(flip_mask(ids, 2, 2, Augment(flip=False)).any())


def test_global_random_states_are_untouched() -> None:
    torch.manual_seed(123)
    np.random.seed(123)
    torch_state = torch.get_rng_state()
    numpy_state = np.random.get_state()
    augment_batch(_images(8), torch.arange(8), 1, 1, Augment())
    assert torch.equal(torch.get_rng_state(), torch_state)
    after = np.random.get_state()
    assert np.array_equal(after[1], numpy_state[1]) and after[2] == numpy_state[2]


def test_an_empty_batch_is_fine() -> None:
    out = augment_batch(_images(0), torch.zeros(0, dtype=torch.int64), 0, 0, Augment())
    assert out.shape == (0, 3, SIZE, SIZE)


@pytest.mark.parametrize(
    ("images", "ids", "named"),
    [
        (_images(4).float(), torch.arange(4), "images"),
        (_images(4)[:, :1], torch.arange(4), "images"),
        (_images(4)[0], torch.arange(4), "images"),
        (np.zeros((4, 3, 8, 8), np.uint8), torch.arange(4), "images"),
        (_images(4), torch.arange(4, dtype=torch.int32), "sample_ids"),
        (_images(4), torch.arange(4).view(2, 2), "sample_ids"),
        (_images(4), torch.arange(3), "sample_ids"),
        (_images(4), [0, 1, 2, 3], "sample_ids"),
    ],
)
def test_bad_input_is_refused_by_name(images: object, ids: object, named: str) -> None:
    with pytest.raises(ValueError, match=named):
        augment_batch(images, ids, 0, 0, Augment())  # type: ignore[arg-type]


@pytest.mark.parametrize("seed", [1.5, "1", True, None])
def test_a_seed_that_is_not_an_int_is_refused(seed: object) -> None:
    with pytest.raises(ValueError, match="seed"):
        augment_batch(_images(2), torch.arange(2), seed, 0, Augment())  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [
        ({"scale": (0.0, 1.0)}, "scale"),
        ({"scale": (0.5, 0.2)}, "scale"),
        ({"scale": (0.5, 1.5)}, "scale"),
        ({"scale": (0.5,)}, "scale"),
        ({"scale": (0.1, math.nan)}, "scale"),
        ({"ratio": (0.0, 1.0)}, "ratio"),
        ({"ratio": (2.0, 1.0)}, "ratio"),
        ({"ratio": "wide"}, "ratio"),
        ({"flip": "yes"}, "flip"),
    ],
)
def test_bad_settings_are_refused_by_name(kwargs: dict[str, object], named: str) -> None:
    with pytest.raises(ValueError, match=f"Augment.{named}") as caught:
        Augment(**kwargs)  # type: ignore[arg-type]
    assert repr(next(iter(kwargs.values()))) in str(caught.value)


def test_settings_from_a_json_list_equal_the_tuple_ones() -> None:
    assert Augment(scale=[0.08, 1], ratio=[0.75, 4 / 3]) == Augment()  # type: ignore[arg-type]


def test_the_draws_are_pinned_so_a_resume_after_an_upgrade_repeats_them() -> None:
    # A change to the hash or the layout of the draws changes every sample's augmentation,
    # and a run resumed across that change would no longer repeat the interrupted one.
    ids = torch.tensor([0, 1, 2, 12345])
    boxes = crop_boxes(ids, 0, 0, Augment(), 32, 32)
    assert boxes.tolist() == [[13, 16, 14, 15], [16, 10, 14, 18], [1, 3, 31, 25], [0, 2, 32, 26]]
    assert flip_mask(ids, 0, 0, Augment()).tolist() == [False, True, True, True]


def test_extreme_seeds_epochs_and_ids_wrap_without_warnings() -> None:
    ids = torch.tensor([-1, 0, 2**63 - 1])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = augment_batch(_images(3), ids, -1, 2**64 - 1, Augment())
        # Seeds count modulo 2**64: -1 is 2**64 - 1.
        assert torch.equal(out, augment_batch(_images(3), ids, 2**64 - 1, -1, Augment()))
