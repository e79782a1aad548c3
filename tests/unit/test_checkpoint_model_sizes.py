"""Model sizes a checkpoint states are checked before anything is allocated.

A checkpoint is data from outside (a registry tag or a user names it): its `model_config`
could ask for a network of any size. Each row writes a real checkpoint whose config lies,
and loads it the way evaluation and champion scoring do; the error names the field, and
comes at once (a regression would try to allocate terabytes, which the time bound and the
memory of this machine would both catch).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torchvision

from ddpflow.checkpoint.store import build_state
from ddpflow.workloads.charlm.config import CharLSTMConfig
from ddpflow.workloads.charlm.config import ModelConfigError as CharConfigError
from ddpflow.workloads.charlm.evaluation import load_model as load_charlm
from ddpflow.workloads.charlm.model import CharLSTM
from ddpflow.workloads.vision.config import ImageModelConfig
from ddpflow.workloads.vision.config import ModelConfigError as ImageConfigError
from ddpflow.workloads.vision.evaluation import load_model as load_images
from ddpflow.workloads.vision.model import build_resnet
from tests.helpers.within import raises_within

pytestmark = pytest.mark.timeout(60)
SMALL = CharLSTMConfig(hidden_size=8, num_layers=1, dropout=0.0)


def charlm_checkpoint(folder: Path, **lie: Any) -> str:
    """A real checkpoint of a small char LSTM whose model_config says `lie`."""
    model = CharLSTM(SMALL)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    uri = str(folder / "epoch-0001.pt")
    torch.save(build_state(model, optimizer, 1, {**SMALL.to_dict(), **lie}), uri)
    return uri


@pytest.mark.parametrize(
    ("lie", "named"),
    [
        ({"hidden_size": 10**9}, "model_config.hidden_size=1000000000 is not an integer from 1"),
        ({"num_layers": 10**6}, "model_config.num_layers=1000000 is not an integer from 1 to 64"),
        ({"hidden_size": "8"}, "model_config.hidden_size='8' is not an integer"),
        ({"vocab_size": 10**7}, "model_config.vocab_size=10000000 is not 31"),
        ({"dropout": 2.0}, "model_config.dropout=2.0 is not in [0, 1)"),
        # In range, but not what the weights hold: 8192 units in 64 layers would be ~140 GB.
        ({"hidden_size": 8192, "num_layers": 64}, "model_config.hidden_size=8192 does not match"),
        ({"num_layers": 64}, "model_config.num_layers=64 does not match"),
    ],
)
def test_a_charlm_checkpoint_stating_sizes_it_does_not_hold_is_refused(
    lie: dict[str, Any], named: str, tmp_path: Path
) -> None:
    uri = charlm_checkpoint(tmp_path, **lie)
    message = raises_within(10, CharConfigError, lambda: load_charlm(uri))
    assert message.startswith(f"{uri}: ") and named in message
    assert "pass a checkpoint written by ddpflow's char-LM training" in message


def test_an_honest_charlm_checkpoint_loads(tmp_path: Path) -> None:
    model, epoch = load_charlm(charlm_checkpoint(tmp_path))
    assert epoch == 1 and model.config == SMALL


def image_checkpoint(folder: Path, **lie: Any) -> str:
    model = build_resnet("resnet18", 3)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    config = ImageModelConfig("resnet18", 3, 32, ("a", "b", "c")).to_dict()
    uri = str(folder / "epoch-0001.pt")
    torch.save(build_state(model, optimizer, 1, {**config, **lie}), uri)
    return uri


@pytest.mark.parametrize(
    ("lie", "named"),
    [
        ({"num_classes": 10**9, "classes": []}, "model_config.num_classes=1000000000 is not an"),
        ({"num_classes": 4}, "model_config.num_classes=4 but it names 3 classes"),
        ({"num_classes": 5000, "classes": []}, "model_config.num_classes=5000 does not match"),
        ({"arch": "resnet152"}, "model_config.arch='resnet152' is not one of resnet18, resnet50"),
        ({"image_size": 10**6}, "model_config.image_size=1000000 is not an integer from 8"),
    ],
)
def test_an_image_checkpoint_stating_sizes_it_does_not_hold_is_refused(
    lie: dict[str, Any], named: str, tmp_path: Path
) -> None:
    uri = image_checkpoint(tmp_path, **lie)
    message = raises_within(10, ImageConfigError, lambda: load_images(uri))
    assert message.startswith(f"{uri}: ") and named in message
    assert "pass a checkpoint written by ddpflow's image training" in message


def test_an_honest_image_checkpoint_loads(tmp_path: Path) -> None:
    model, config, epoch = load_images(image_checkpoint(tmp_path))
    assert epoch == 1 and config.num_classes == 3
    assert isinstance(model.backbone, torchvision.models.ResNet)
