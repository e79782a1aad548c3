"""What a user asks of training speed (`SpeedSettings`), free of torch.

The flows build these settings from their parameters in a process that starts without torch
(it would add seconds to every flow run's start); each rank resolves them into a
`TrainSpeed` on its device (`ddpflow.training.speed.device.resolve_speed`), which also
explains the settings.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    import torch

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


PLAIN = SpeedSettings()  # the defaults: nothing changes
