"""The ResNet factory: shapes, frozen backbone, weights from a URI, ImageNet offline."""

from __future__ import annotations

import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch
import torchvision

from ddpflow import storage
from ddpflow.registry.serving import LogitsOnly
from ddpflow.workloads.vision.config import ImageModelConfig
from ddpflow.workloads.vision.model import (
    WeightsError,
    build_resnet,
    resolve_weights,
    trainable_parameters,
)

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py


def images(n: int = 2, size: int = 32) -> torch.Tensor:
    return torch.randint(0, 256, (n, 3, size, size), dtype=torch.uint8)


@pytest.mark.parametrize(("arch", "features"), [("resnet18", 512), ("resnet50", 2048)])
def test_new_head_for_the_number_of_classes(arch: str, features: int) -> None:
    model = build_resnet(arch, num_classes=7)
    assert model.backbone.fc.in_features == features and model.backbone.fc.out_features == 7
    logits, loss = model(images(), torch.tensor([0, 6]))
    assert logits.shape == (2, 7) and loss.ndim == 0 and loss.item() > 0
    logits_only, no_loss = model(images(3, 16))
    assert logits_only.shape == (3, 7) and no_loss is None
    assert LogitsOnly(model.eval())(images()).shape == (2, 7)


def test_frozen_backbone_trains_only_the_head_and_keeps_batchnorm_statistics() -> None:
    model = build_resnet("resnet18", 4, freeze_backbone=True)
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    assert names == ["backbone.fc.weight", "backbone.fc.bias"]
    assert len(trainable_parameters(model)) == 2
    model.train()
    assert model.training and not model.backbone.bn1.training
    before = model.backbone.bn1.running_mean.clone()
    model(images())
    assert torch.equal(model.backbone.bn1.running_mean, before)
    assert all(p.requires_grad for p in build_resnet("resnet18", 4).parameters())


def test_weights_uri_round_trip_keeps_the_body_and_replaces_the_head(tmp_path: Path) -> None:
    torch.manual_seed(1)
    source = torchvision.models.resnet18()  # 1000-class head, as torchvision saves them
    uri = str(tmp_path / "weights" / "r18.pt")
    storage.save_torch(uri, source.state_dict())
    model = build_resnet("resnet18", 3, weights=uri)
    assert torch.equal(model.backbone.conv1.weight, source.conv1.weight)
    assert torch.equal(model.backbone.layer4[1].bn2.running_var, source.layer4[1].bn2.running_var)
    assert model.backbone.fc.out_features == 3
    # A ddpflow checkpoint (model_state with the backbone. prefix) works as well.
    storage.save_torch(uri, {"model_state": model.state_dict(), "epoch": 1})
    again = build_resnet("resnet18", 5, weights=uri)
    assert torch.equal(again.backbone.conv1.weight, source.conv1.weight)
    assert resolve_weights("resnet18", uri, str(tmp_path)) == uri


def test_weights_for_another_arch_are_rejected_clearly(tmp_path: Path) -> None:
    uri = str(tmp_path / "r18.pt")
    storage.save_torch(uri, torchvision.models.resnet18().state_dict())
    with pytest.raises(WeightsError, match="do not fit resnet50"):
        build_resnet("resnet50", 3, weights=uri)
    with pytest.raises(WeightsError, match="does not exist"):
        resolve_weights("resnet18", str(tmp_path / "nope.pt"), str(tmp_path))


def test_imagenet_without_network_says_what_to_do(monkeypatch, tmp_path: Path) -> None:
    """The download is the one thing mocked: this machine has no network to fail on."""

    def offline(*args, **kwargs):
        raise urllib.error.URLError("[Errno -2] Name or service not known")

    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch"))  # an empty hub cache
    monkeypatch.setattr(urllib.request, "urlopen", offline)
    with pytest.raises(WeightsError) as error:
        build_resnet("resnet18", 3, weights="imagenet")
    message = str(error.value)
    assert "ImageNet weights for resnet18" in message and "download.pytorch.org" in message
    assert "weights=<URI>" in message and "weights=none" in message
    with pytest.raises(WeightsError, match="weights=none"):
        resolve_weights("resnet18", "imagenet", str(tmp_path))
    assert not (tmp_path / "data").exists()


def test_unknown_arch_and_too_few_classes_are_rejected() -> None:
    with pytest.raises(ValueError, match="resnet18, resnet50"):
        build_resnet("vgg11", 3)
    with pytest.raises(ValueError, match="at least 2"):
        build_resnet("resnet18", 1)


def test_config_round_trips_through_a_dict() -> None:
    config = ImageModelConfig("resnet50", 3, 64, ("a", "b", "c"), True)
    assert ImageModelConfig.from_dict(config.to_dict()) == config
    assert config.to_dict()["classes"] == ["a", "b", "c"]
