"""What a user asks of training speed (`SpeedSettings`), free of torch.

The flows build these settings from their parameters in a process that starts without torch
(it would add seconds to every flow run's start); each rank resolves them into a
`ddpflow.speed.TrainSpeed` on its device. ddpflow.speed explains the settings.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    import torch

    from ddpflow.speed import TrainSpeed

Precision = Literal["auto", "fp32", "bf16", "fp16"]
PRECISIONS: tuple[str, ...] = ("auto", "fp32", "bf16", "fp16")
Toggle = bool | Literal["auto"]


class SpeedError(ValueError):
    """A speed setting cannot run on this device (raised before any training)."""


@dataclass(frozen=True)
class CudaCaps:
    """What the GPU supports; probed on the rank, passed by hand in tests."""

    bf16: bool
    tf32: bool  # Ampere (compute capability 8.0) and later

    @classmethod
    def probe(cls, device: torch.device) -> CudaCaps:
        import torch

        major, _ = torch.cuda.get_device_capability(device)
        return cls(bf16=torch.cuda.is_bf16_supported(), tf32=major >= 8)


@dataclass(frozen=True)
class SpeedSettings:
    """What the user asked for. The defaults change nothing: fp32, contiguous, unpinned."""

    precision: str = "fp32"
    channels_last: Toggle = False
    pin_memory: Toggle = False
    compile: bool = False

    def __post_init__(self) -> None:
        if self.precision not in PRECISIONS:
            raise SpeedError(
                f"precision={self.precision!r} is not one of {', '.join(PRECISIONS)}; "
                "pass auto (bf16 on GPUs, fp32 on CPU) or one of them"
            )
        for name in ("channels_last", "pin_memory"):
            if getattr(self, name) not in (True, False, "auto"):
                raise SpeedError(f"{name}={getattr(self, name)!r}: pass true, false or auto")

    def resolve(
        self, device: torch.device, caps: CudaCaps | None = None, images: bool = False
    ) -> TrainSpeed:
        """What runs on `device`. `caps` defaults to probing the GPU (CUDA devices only);
        `images`: the model takes [N, C, H, W] images, so channels_last can apply."""
        from ddpflow.speed import TrainSpeed

        cuda = device.type == "cuda"
        if cuda and caps is None:
            caps = CudaCaps.probe(device)
        precision = self._precision(cuda, caps)
        notes = []
        auto_cl = self.channels_last == "auto" and cuda and images
        channels_last = self.channels_last is True or auto_cl
        if channels_last and not images:
            raise SpeedError("channels_last=true applies to image models only; pass false or auto")
        pin = self.pin_memory is True or (self.pin_memory == "auto" and cuda)
        if pin and not cuda:
            # Page-locked memory only speeds up host-to-GPU copies; on CPU it is a copy more.
            notes.append("pin_memory: no CUDA device, so nothing is pinned")
            pin = False
        # TF32 speeds up the fp32 matmuls and convolutions left outside autocast; an explicit
        # precision=fp32 asks for strict fp32, so TF32 stays off then.
        tf32 = cuda and caps is not None and caps.tf32 and self.precision != "fp32"
        return TrainSpeed(
            precision=precision,
            channels_last=channels_last,
            pin_memory=pin,
            tf32=tf32,
            compile=self.compile,
            device=device,
            notes=tuple(notes),
        )

    def _precision(self, cuda: bool, caps: CudaCaps | None) -> str:
        if self.precision == "auto":
            if not cuda:
                return "fp32"
            return "bf16" if caps is not None and caps.bf16 else "fp16"
        if self.precision == "bf16" and cuda and caps is not None and not caps.bf16:
            raise SpeedError("precision='bf16': this GPU has no bf16; pass fp16 or auto")
        if self.precision == "fp16" and not cuda:
            raise SpeedError(
                "precision='fp16' needs a CUDA device (fp16 with a GradScaler); on CPU "
                "pass bf16, fp32 or auto"
            )
        return self.precision


PLAIN = SpeedSettings()  # the defaults: nothing changes
