"""The image model's description, free of torch: the flow process builds it from its
parameters and starts without torch (ddpflow.workloads.vision.model builds the network from it)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True)
class ImageModelConfig:
    """What rebuilds the model from a checkpoint (weights are in the state_dict)."""

    arch: str
    num_classes: int
    image_size: int
    classes: tuple[str, ...] = ()
    freeze_backbone: bool = False

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "classes": list(self.classes)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ImageModelConfig:
        return cls(**{**data, "classes": tuple(data.get("classes", ()))})
