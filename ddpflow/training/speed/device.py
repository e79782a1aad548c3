"""Training speed settings: mixed precision, TF32, channels_last, pinned memory, torch.compile.

A workload's job carries `SpeedSettings` (what the user asked, "auto" allowed); each rank
resolves them against its device into a `TrainSpeed` (what runs) before any training, and
fit() calls three things of it per step: `to_device`, `autocast` and `backward_and_step`.

"auto" means: on CUDA, bf16 autocast (fp16 with a GradScaler where the GPU has no bf16),
TF32 where the GPU has it, channels_last for the ResNets and pinned host memory; on CPU,
none of them (fp32, contiguous, unpinned), because bf16 on most CPUs is slower than fp32
and pinning needs a CUDA device. Validation runs outside autocast, in fp32, so val_loss
and the scheduler's decisions are comparable between precisions.

Exact resume: autocast, channels_last and pinning change no RNG use and no optimizer
state, so a resumed run repeats the uninterrupted one as long as the kernels are
deterministic. The GradScaler's scale and growth tracker are training state: they are
saved in the checkpoint (`scaler_state`) and restored with the model.
"""

from __future__ import annotations

import contextlib
import copy
import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

import torch
from torch import nn

from ddpflow.training.speed.settings import CudaCaps, SpeedError, SpeedSettings

if TYPE_CHECKING:  # annotations only: the loop and checkpoint modules import this one
    from ddpflow.training.context import TrainContext

M = TypeVar("M", bound=nn.Module)
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
# Devices where the built-in workloads' Adam and SGD run fused: one kernel updates every
# parameter, instead of a few per tensor. On CPU a ResNet-18 Adam step took 0.0135 CPU-s
# fused against 0.087 (0.082 foreach), 40 % of the image training's time before; torch
# leaves fused off by default. The same update, to rounding: a fused run's checkpoint
# resumes in a fused run exactly (the optimizer state has the same tensors).
FUSED_OPTIMIZER_DEVICES = ("cpu", "cuda")


@dataclass
class TrainSpeed:
    """The resolved settings of one rank, with the GradScaler (enabled for fp16 only)."""

    precision: str = "fp32"
    channels_last: bool = False
    pin_memory: bool = False
    tf32: bool = False
    compile: bool = False
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    notes: tuple[str, ...] = ()
    scaler: torch.amp.GradScaler = field(init=False)

    def __post_init__(self) -> None:
        # Disabled, scale() returns the loss and step() calls optimizer.step(): plain fp32.
        self.scaler = torch.amp.GradScaler(self.device.type, enabled=self.precision == "fp16")

    @property
    def fused_optimizer(self) -> bool:
        """Whether the workloads build their optimizer fused (FUSED_OPTIMIZER_DEVICES)."""
        return self.device.type in FUSED_OPTIMIZER_DEVICES

    def describe(self) -> dict[str, Any]:
        """The resolved values, for the run's log line."""
        keys = ("precision", "channels_last", "pin_memory", "tf32", "compile", "fused_optimizer")
        return {k: getattr(self, k) for k in keys}

    def apply_to_model(self, model: M) -> M:
        """Process-wide TF32 switch and the model's memory format (call before DDP wraps it)."""
        if self.device.type == "cuda":
            torch.backends.cuda.matmul.allow_tf32 = self.tf32
            torch.backends.cudnn.allow_tf32 = self.tf32
        if self.channels_last:
            model = model.to(memory_format=torch.channels_last)
        return model

    def check_runs(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> None:
        """One training step of a copy of `model` on a tiny batch, so a precision this
        machine's kernels lack fails before training with the fix, not at the first step
        (e.g. bf16 LSTMs need a CPU with bf16 instructions). The model and the RNG are left
        as they were."""
        if self.precision == "fp32":
            return  # every kernel has fp32
        probe = copy.deepcopy(model)
        try:
            with torch.random.fork_rng(devices=[]), self.autocast():
                _, loss = probe(self.to_device(x), self.to_device(y))
            loss.backward()
        except RuntimeError as error:
            raise SpeedError(
                f"precision={self.precision!r} does not run on this {self.device.type} "
                f"({str(error).splitlines()[0][:200]}); pass fp32 or auto"
            ) from error

    def compile_model(self, model: nn.Module) -> nn.Module:
        """torch.compile in place (nn.Module.compile), so the state_dict keys do not change
        and checkpoints stay loadable by an uncompiled model."""
        if self.compile:
            model.compile()
        return model

    def to_device(self, tensor: torch.Tensor) -> torch.Tensor:
        """Host batch -> device: pinned first when asked, so the copy can be asynchronous;
        4-D image batches become channels_last when asked. uint8 images stay uint8 here:
        a quarter of the bytes cross to the device, where the model normalises them. A
        tensor already on a GPU (images a rank decoded there: ddpflow.shards.decoding) has
        nothing to pin, and pinning one fails."""
        if self.pin_memory and tensor.device.type == "cpu":
            tensor = tensor.pin_memory()
        tensor = tensor.to(self.device, non_blocking=True)
        if self.channels_last and tensor.dim() == 4:
            tensor = tensor.contiguous(memory_format=torch.channels_last)
        return tensor

    @contextlib.contextmanager
    def autocast(self) -> Iterator[None]:
        """Around the training forward (and its loss): the mixed-precision region."""
        if self.precision == "fp32":
            yield
            return
        with torch.autocast(self.device.type, dtype=DTYPES[self.precision]):
            yield

    def backward_and_step(self, loss: torch.Tensor, optimizer: torch.optim.Optimizer) -> None:
        """backward + step through the GradScaler (fp16 skips steps with inf/nan gradients
        and adjusts the scale); with the scaler disabled exactly backward + step."""
        self.scaler.scale(loss).backward()
        self.scaler.step(optimizer)
        self.scaler.update()

    def state_dict(self) -> dict[str, Any]:
        """For the checkpoint: the GradScaler's state ({} when it is disabled)."""
        return self.scaler.state_dict()

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        """Restore the GradScaler; a checkpoint without scaler state (written at fp32 or bf16)
        leaves a fresh scaler, as if fp16 started at that checkpoint."""
        if self.scaler.is_enabled() and state:
            self.scaler.load_state_dict(state)


def announce(speed: TrainSpeed, ctx: TrainContext) -> None:
    """Rank 0 says what runs: a progress line (with why a setting did nothing) and the
    resolved values as the run's `ddpflow.speed` tag, next to the requested
    parameters."""
    if not ctx.is_main:
        return
    resolved = speed.describe()
    ctx.report("speed settings: " + ", ".join(f"{k}={v}" for k, v in resolved.items()))
    for note in speed.notes:
        ctx.report(note)
    ctx.metric_logger.set_tags({"ddpflow.speed": json.dumps(resolved)})


def resolve_speed(
    settings: SpeedSettings,
    device: torch.device,
    caps: CudaCaps | None = None,
    images: bool = False,
) -> TrainSpeed:
    """What `settings` run as on `device`. `caps` defaults to probing the GPU (CUDA devices only);
    `images`: the model takes [N, C, H, W] images, so channels_last can apply."""
    cuda = device.type == "cuda"
    if cuda and caps is None:
        caps = CudaCaps.probe(device)
    precision = _precision(settings, cuda, caps)
    notes = []
    auto_cl = settings.channels_last == "auto" and cuda and images
    channels_last = settings.channels_last is True or auto_cl
    if channels_last and not images:
        raise SpeedError("channels_last=true applies to image models only; pass false or auto")
    pin = settings.pin_memory is True or (settings.pin_memory == "auto" and cuda)
    if pin and not cuda:
        # Page-locked memory only speeds up host-to-GPU copies; on CPU it is a copy more.
        notes.append("pin_memory: no CUDA device, so nothing is pinned")
        pin = False
    # TF32 speeds up the fp32 matmuls and convolutions left outside autocast; an explicit
    # precision=fp32 asks for strict fp32, so TF32 stays off then.
    tf32 = cuda and caps is not None and caps.tf32 and settings.precision != "fp32"
    return TrainSpeed(
        precision=precision,
        channels_last=channels_last,
        pin_memory=pin,
        tf32=tf32,
        compile=settings.compile,
        device=device,
        notes=tuple(notes),
    )


def _precision(settings: SpeedSettings, cuda: bool, caps: CudaCaps | None) -> str:
    if settings.precision == "auto":
        if not cuda:
            return "fp32"
        return "bf16" if caps is not None and caps.bf16 else "fp16"
    if settings.precision == "bf16" and cuda and caps is not None and not caps.bf16:
        raise SpeedError("precision='bf16': this GPU has no bf16; pass fp16 or auto")
    if settings.precision == "fp16" and not cuda:
        raise SpeedError(
            "precision='fp16' needs a CUDA device (fp16 with a GradScaler); on CPU "
            "pass bf16, fp32 or auto"
        )
    return settings.precision
