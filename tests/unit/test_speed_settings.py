"""Speed settings: "auto" per device, refusals that name the setting, the GradScaler in the
checkpoint, autocast inside the model and the image normalisation applied once, on device.

CUDA cases use `torch.device("cuda")` with hand-written `CudaCaps`: a faked GPU for the
resolution logic only (this machine has none; nothing is run on it).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from ddpflow.checkpoint.store import CheckpointStore, build_state, encode, resume_from
from ddpflow.distributed.context import RankContext
from ddpflow.training.loop import FitHooks, FitPlan, fit_loop
from ddpflow.training.samples import TensorSamples
from ddpflow.training.speed.device import TrainSpeed, resolve_speed
from ddpflow.training.speed.settings import CudaCaps, SpeedError, SpeedSettings
from ddpflow.workloads.vision.model import IMAGENET_MEAN, IMAGENET_STD, build_resnet

CPU = torch.device("cpu")
FAKE_GPU = torch.device("cuda")  # never used for tensors: no GPU here
AMPERE = CudaCaps(bf16=True, tf32=True)
VOLTA = CudaCaps(bf16=False, tf32=False)


def test_auto_on_cpu_changes_nothing() -> None:
    speed = resolve_speed(SpeedSettings("auto", "auto", "auto"), CPU, images=True)
    assert speed.describe() == {
        "precision": "fp32",
        "channels_last": False,
        "pin_memory": False,
        "tf32": False,
        "compile": False,
        "fused_optimizer": True,
    }
    assert not speed.scaler.is_enabled() and speed.notes == ()


def test_pinning_on_cpu_is_a_no_op_that_says_why() -> None:
    speed = resolve_speed(SpeedSettings(pin_memory=True), CPU)
    assert speed.pin_memory is False
    assert speed.notes == ("pin_memory: no CUDA device, so nothing is pinned",)


def test_auto_on_a_faked_bf16_gpu() -> None:
    images = resolve_speed(SpeedSettings("auto", "auto", "auto"), FAKE_GPU, AMPERE, images=True)
    assert (images.precision, images.channels_last, images.pin_memory, images.tf32) == (
        "bf16",
        True,
        True,
        True,
    )
    lstm = resolve_speed(SpeedSettings("auto", "auto", "auto"), FAKE_GPU, AMPERE)
    assert lstm.channels_last is False, "channels_last applies to image models only"


@pytest.mark.filterwarnings("ignore:torch.cuda.amp.GradScaler is enabled")  # no real GPU
def test_auto_on_a_faked_gpu_without_bf16_is_fp16_and_strict_fp32_has_no_tf32() -> None:
    assert resolve_speed(SpeedSettings("auto"), FAKE_GPU, VOLTA).precision == "fp16"
    assert resolve_speed(SpeedSettings("fp32"), FAKE_GPU, AMPERE).tf32 is False
    assert resolve_speed(SpeedSettings("bf16"), FAKE_GPU, AMPERE).tf32 is True


@pytest.mark.parametrize(
    ("settings", "device", "caps", "match"),
    [
        (dict(precision="fp8"), CPU, None, r"precision='fp8' is not one of .*pass auto"),
        (dict(precision="fp16"), CPU, None, r"precision='fp16' needs a CUDA device.*pass bf16"),
        (dict(precision="bf16"), FAKE_GPU, VOLTA, r"precision='bf16'.*no bf16; pass fp16"),
        (dict(channels_last=True), CPU, None, r"channels_last=true applies to image models"),
        (dict(pin_memory="yes"), CPU, None, r"pin_memory='yes': pass true, false or auto"),
    ],
)
def test_a_setting_the_device_cannot_run_is_named_with_the_fix(settings, device, caps, match):
    with pytest.raises(SpeedError, match=match):
        resolve_speed(SpeedSettings(**settings), device, caps)


def test_a_precision_the_cpu_kernels_lack_fails_before_training() -> None:
    class Broken(nn.Module):
        def forward(self, x, y):
            if torch.is_autocast_enabled("cpu"):
                raise RuntimeError("could not create a primitive descriptor\nmore")
            return x, x.sum()

    speed = resolve_speed(SpeedSettings("bf16"), CPU)
    with pytest.raises(SpeedError, match=r"precision='bf16' does not run .*primitive.*fp32"):
        speed.check_runs(Broken(), torch.zeros(2), torch.zeros(2))
    resolve_speed(SpeedSettings("fp32"), CPU).check_runs(Broken(), torch.zeros(2), torch.zeros(2))


def test_the_grad_scaler_state_round_trips_through_a_checkpoint(tmp_path) -> None:
    """fp16 needs a GPU; its GradScaler is enabled here on CPU to check the state only."""
    model = nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    saved = TrainSpeed(precision="fp16")
    saved.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=3)
    # An overflowing step halves the scale; a finite one advances the growth tracker.
    for value in (float("inf"), 1.0):
        saved.scaler.scale(model(torch.full((1, 2), value)).sum()).backward()
        saved.scaler.step(optimizer)
        saved.scaler.update()
        optimizer.zero_grad()
    assert saved.scaler.get_scale() == 2.0**9
    store = CheckpointStore(str(tmp_path))
    state = build_state(model, optimizer, 1, {}, speed=saved)
    store.save_encoded(1, encode(state))
    restored = TrainSpeed(precision="fp16")
    restored.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16, growth_interval=3)
    objects = {
        "model": nn.Linear(2, 2),
        "optimizer": torch.optim.SGD(model.parameters(), lr=0.1),
        "scaler": restored,
    }
    assert resume_from(store, objects)[:2] == (1, None)
    assert restored.scaler.state_dict() == saved.scaler.state_dict()
    assert restored.scaler.state_dict()["_growth_tracker"] == 1


class Recording(nn.Module):
    """Records the dtype its layer computes in during training."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(4, 2)
        self.dtypes: list[torch.dtype] = []

    def forward(self, x, targets=None):
        logits = self.layer(x)
        if self.training:
            self.dtypes.append(logits.dtype)
        return logits, F.cross_entropy(logits.float(), targets)


@pytest.mark.parametrize(
    ("precision", "dtype"), [("bf16", torch.bfloat16), ("fp32", torch.float32)]
)
def test_fit_runs_the_training_forward_under_autocast(precision, dtype) -> None:
    torch.manual_seed(0)
    data = torch.randn(8, 4)
    model = Recording()
    to_batch = lambda index: (data[index], (data[index, 0] > 0).long())  # noqa: E731
    fit_loop(
        model=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        train=TensorSamples(torch.arange(8), to_batch),
        val=TensorSamples(torch.arange(4), to_batch),
        ctx=RankContext(rank=0, world_size=1, device=CPU, backend="none"),
        logger=_NoLog(),
        save_checkpoint=lambda epoch: None,
        plan=FitPlan(epochs=1, batch_size=4, seed=0),
        hooks=FitHooks(speed=resolve_speed(SpeedSettings(precision), CPU)),
    )
    assert model.dtypes == [dtype, dtype]
    assert model.layer.weight.dtype == torch.float32, "the weights stay fp32"


class _NoLog:
    def log_metrics(self, metrics, step):
        pass


def test_uint8_images_cross_to_the_device_and_are_normalised_once_there() -> None:
    speed = resolve_speed(SpeedSettings(channels_last=True), CPU, images=True)
    model = speed.apply_to_model(build_resnet("resnet18", 2))
    seen: list[torch.Tensor] = []
    model.backbone.register_forward_pre_hook(lambda module, args: seen.append(args[0]))
    x = speed.to_device(torch.full((2, 3, 8, 8), 255, dtype=torch.uint8))
    assert x.dtype == torch.uint8, "a quarter of the bytes of float32 cross to the device"
    assert x.is_contiguous(memory_format=torch.channels_last)
    model(x)
    mean, std = torch.tensor(IMAGENET_MEAN), torch.tensor(IMAGENET_STD)
    expected = ((1 - mean) / std).view(1, 3, 1, 1).expand(2, 3, 8, 8)
    assert torch.allclose(seen[0], expected, atol=1e-5)
    assert seen[0].is_contiguous(memory_format=torch.channels_last)


def test_compile_is_in_place_so_checkpoint_keys_do_not_change() -> None:
    """Only the wrapping is checked: compiling on this CPU takes too long for a unit test."""
    model = nn.Linear(2, 2)
    keys = list(model.state_dict())
    resolve_speed(SpeedSettings(compile=False), CPU).compile_model(model)
    assert model._compiled_call_impl is None
    resolve_speed(SpeedSettings(compile=True), CPU).compile_model(model)
    assert model._compiled_call_impl is not None
    assert list(model.state_dict()) == keys


def test_a_batch_already_off_the_cpu_is_not_pinned() -> None:
    """A rank that decodes its images on its GPU hands them over there: pinning such a tensor
    fails. A meta tensor stands in for a CUDA one (no GPU here); a CPU one would be pinned,
    which needs a CUDA device and fails on this machine, so the test fails if the check goes."""
    speed = TrainSpeed(pin_memory=True, device=torch.device("meta"))
    moved = speed.to_device(torch.empty((2, 3, 4, 4), dtype=torch.uint8, device="meta"))
    assert moved.device.type == "meta"
    with pytest.raises(RuntimeError):
        speed.to_device(torch.empty((2, 3, 4, 4), dtype=torch.uint8))  # a host batch: pinned


def test_the_workloads_optimizer_is_fused_where_torch_has_the_kernels() -> None:
    settings = SpeedSettings("auto", "auto", "auto")
    assert resolve_speed(settings, CPU).fused_optimizer is True
    assert resolve_speed(settings, FAKE_GPU, AMPERE).fused_optimizer is True
    assert resolve_speed(settings, torch.device("mps")).fused_optimizer is False
