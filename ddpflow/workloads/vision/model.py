"""ResNet-18/50 from torchvision with a new head, behind the project's model interface.

`ImageClassifier.forward(x, targets=None) -> (logits, loss)` is the interface the training
loop expects of every model, so one loop trains both workloads. It takes the formatted uint8
images [N, 3, H, W] and does the scaling and ImageNet normalisation itself,
so a registered model needs the images and nothing of ddpflow to serve them.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
import torchvision
from torch import nn

from ddpflow import storage
from ddpflow.storage.redact import redact_url
from ddpflow.workloads.vision.config import ARCHS
from ddpflow.workloads.vision.pretrained import WeightsError, fetch_imagenet_state

Arch = Literal["resnet18", "resnet50"]
# The statistics torchvision's ImageNet weights were trained with; harmless from scratch.
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


class ImageClassifier(nn.Module):
    mean: torch.Tensor  # buffers (registered in __init__)
    std: torch.Tensor

    def __init__(self, backbone: nn.Module, freeze_backbone: bool = False):
        super().__init__()
        self.backbone = backbone
        self.freeze_backbone = freeze_backbone
        # Not persistent: the state_dict is the backbone's alone (`backbone.` + torchvision keys).
        mean = torch.tensor(IMAGENET_MEAN).view(1, 3, 1, 1) * 255
        self.register_buffer("mean", mean, persistent=False)
        self.register_buffer("std", torch.tensor(IMAGENET_STD).view(1, 3, 1, 1) * 255, False)
        if freeze_backbone:
            for name, param in backbone.named_parameters():
                param.requires_grad = name.startswith("fc.")

    def forward(
        self, x: torch.Tensor, targets: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        logits = self.backbone((x.float() - self.mean) / self.std)
        loss = F.cross_entropy(logits, targets) if targets is not None else None
        return logits, loss

    def train(self, mode: bool = True) -> ImageClassifier:
        super().train(mode)
        if self.freeze_backbone:
            # A frozen backbone keeps its pretrained BatchNorm statistics; in train mode they
            # would drift towards the new data although the weights around them cannot adapt.
            self.backbone.eval()
        return self


def build_resnet(
    arch: str, num_classes: int, weights: str = "none", freeze_backbone: bool = False
) -> ImageClassifier:
    """A torchvision ResNet with a new `num_classes` head.

    weights: "none" (random init), "imagenet" (torchvision's weights enum; needs network or
    a cached copy) or the URI of a state_dict in the artifact store (torch.save of a
    torchvision ResNet's state_dict, or a ddpflow image checkpoint).
    """
    if arch not in ARCHS:
        raise ValueError(f"arch={arch!r} is not supported; choose one of {', '.join(ARCHS)}")
    if num_classes < 2:
        raise ValueError(f"num_classes={num_classes} must be at least 2")
    backbone = torchvision.models.get_model(arch, weights=None)
    state = load_pretrained_state(arch, weights)
    if state is not None:
        _load_backbone(backbone, state, arch, weights)
    backbone.fc = nn.Linear(backbone.fc.in_features, num_classes)
    return ImageClassifier(backbone, freeze_backbone)


def load_pretrained_state(arch: str, weights: str) -> dict[str, torch.Tensor] | None:
    if weights == "none":
        return None
    if weights == "imagenet":
        return fetch_imagenet_state(arch)
    # weights_only=True: tensors, never pickled code; a capped, regular file, read in time.
    state = storage.load_torch(weights, "pass weights= the URI of a saved state_dict")
    if isinstance(state, dict) and "model_state" in state:  # a ddpflow checkpoint
        state = state["model_state"]
    if not isinstance(state, dict):
        raise WeightsError(f"{redact_url(weights)} does not hold a state_dict")
    prefix = "backbone."
    if any(k.startswith(prefix) for k in state):
        return {k.removeprefix(prefix): v for k, v in state.items() if k.startswith(prefix)}
    return state


def resolve_weights(arch: str, weights: str, artifact_root: str) -> str | None:
    """What the ranks load: None, or the URI of a state_dict already checked against `arch`.

    ImageNet weights are fetched once here and kept in the artifact store, instead of by
    every rank on every worker; a bad URI or a wrong architecture fails before training.
    """
    if weights == "none":
        return None
    uri = weights
    if weights == "imagenet":
        enum = torchvision.models.get_model_weights(arch).DEFAULT
        uri = storage.join(artifact_root, "data", "weights", f"{arch}-{enum.name}.pt")
        if not storage.exists(uri):
            storage.save_torch(uri, fetch_imagenet_state(arch))
    elif not storage.exists(uri):
        raise WeightsError(
            f"weights={redact_url(uri)} does not exist; pass the URI of a saved state_dict, "
            "'imagenet' or 'none'"
        )
    build_resnet(arch, 2, uri)  # loads and checks every tensor's name and shape
    return uri


def _load_backbone(
    backbone: nn.Module, state: dict[str, torch.Tensor], arch: str, source: str
) -> None:
    # The head is always new (its size is this dataset's class count), so fc.* is dropped.
    body = {k: v for k, v in state.items() if not k.startswith("fc.")}
    shown = "ImageNet" if source == "imagenet" else redact_url(source)
    try:
        missing, unexpected = backbone.load_state_dict(body, strict=False)
    except RuntimeError as error:  # shape mismatches, e.g. resnet50 weights for resnet18
        raise WeightsError(f"weights {shown} do not fit {arch}: {error}"[:1500]) from error
    missing = [k for k in missing if not k.startswith("fc.")]
    if missing or unexpected:
        raise WeightsError(
            f"weights {shown} do not fit {arch}: missing {missing[:5]}, unexpected "
            f"{unexpected[:5]} (is it a state_dict of torchvision's {arch}?)"
        )


def trainable_parameters(model: nn.Module) -> list[nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]
