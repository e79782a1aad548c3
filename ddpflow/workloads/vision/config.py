"""The image model's description, free of torch: the flow process builds it from its
parameters and starts without torch (ddpflow.workloads.vision.model builds the network from it)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

ARCHS: tuple[str, ...] = ("resnet18", "resnet50")
# The side of the square model input (the image flow's image_size parameter).
MIN_IMAGE_SIZE = 8
MAX_IMAGE_SIZE = 1024
# A head for more classes than this is no image folder ddpflow trained (ImageNet-21k has
# ~21,000); a ResNet-50 head for 100,000 classes is 800 MB already.
MAX_NUM_CLASSES = 100_000


class ModelConfigError(ValueError):
    """A `model_config` read back (from a checkpoint) that no ddpflow training wrote."""


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
    def from_dict(cls, data: Any) -> ImageModelConfig:
        """The config a checkpoint states, checked field by field before anything is built.

        ModelConfigError names the field: a checkpoint is data from outside (a registry tag
        or a user names it), and num_classes=10**9 would allocate a 8 TB head.
        """
        if not isinstance(data, dict):
            raise ModelConfigError(f"model_config is a {type(data).__name__}, not a dict")
        missing = [k for k in ("arch", "num_classes", "image_size") if k not in data]
        if missing:
            raise ModelConfigError(f"model_config has no {', '.join(missing)}")
        classes = data.get("classes", ())
        if not isinstance(classes, list | tuple) or not all(isinstance(c, str) for c in classes):
            raise ModelConfigError("model_config.classes is not a list of class names")
        fields = {k: data[k] for k in cls.__dataclass_fields__ if k in data}
        config = cls(**{**fields, "classes": tuple(classes)})
        if config.arch not in ARCHS:
            raise ModelConfigError(
                f"model_config.arch={config.arch!r:.40} is not one of {', '.join(ARCHS)}"
            )
        _check_int("num_classes", config.num_classes, 2, MAX_NUM_CLASSES)
        _check_int("image_size", config.image_size, MIN_IMAGE_SIZE, MAX_IMAGE_SIZE)
        if config.classes and len(config.classes) != config.num_classes:
            raise ModelConfigError(
                f"model_config.num_classes={config.num_classes} but it names "
                f"{len(config.classes)} classes"
            )
        if not isinstance(config.freeze_backbone, bool):
            raise ModelConfigError("model_config.freeze_backbone is not true or false")
        return config


def _check_int(field: str, value: Any, low: int, high: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ModelConfigError(
            f"model_config.{field}={value!r:.40} is not an integer from {low} to {high}"
        )
