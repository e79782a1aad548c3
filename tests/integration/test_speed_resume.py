"""Each speed setting this CPU runs trains and resumes exactly, through each workload's rank.

A 2-epoch run is compared with a run resumed from its epoch-1 checkpoint: the final
weights, optimizer state and GradScaler state must be bitwise equal. fp32, channels_last
and bf16 autocast are deterministic on CPU (same kernels, same order, RNG reseeded per
epoch), so no tolerance is needed. The image bf16 case runs with channels_last: on a CPU
without bf16 instructions contiguous bf16 convolutions take seconds a step. bf16 LSTMs
need such instructions; where the CPU lacks them the rank refuses bf16 before training,
and that refusal is checked instead.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from ddpflow import storage
from ddpflow.checkpoint.store import CheckpointStore
from ddpflow.distributed.context import RankSpec, process_group
from ddpflow.tracking.loggers import RunRef
from ddpflow.training.context import TrainContext
from ddpflow.training.speed.settings import SpeedError, SpeedSettings
from ddpflow.workloads.charlm import training as charlm_training
from ddpflow.workloads.charlm.config import CharLSTMConfig
from ddpflow.workloads.vision import training as vision_training
from ddpflow.workloads.vision.config import ImageModelConfig
from infra.procs import free_port

pytestmark = pytest.mark.integration

RUN = RunRef("unused", "unused")


class _Logger:
    def __init__(self) -> None:
        self.tags: dict[str, str] = {}

    def log_metrics(self, metrics, step) -> None:
        pass

    def log_artifact(self, local_path, artifact_path=None, origin=None) -> None:
        pass

    def keep_artifacts(self, artifact_path, names) -> None:
        pass

    def set_tags(self, tags) -> None:
        self.tags.update(tags)


def _rank(train: Callable[[Any, Any], Any], job: Any, logger: Any = None) -> Any:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with process_group(RankSpec(0, 1, "127.0.0.1", free_port(), "gloo", 60, "t")) as ctx:
            return train(TrainContext(ctx, job.train_settings(), logger or _Logger()), job)
    finally:
        torch.set_num_threads(threads)


def _assert_resume_is_exact(run: Callable[[str], Any], tmp_path: Path) -> None:
    """run(checkpoint_root) trains to epoch 2, resuming from the root's latest checkpoint."""
    full = str(tmp_path / "full")
    run(full)
    resumed = str(tmp_path / "resumed")
    # The uninterrupted run's epoch-1 checkpoint, as if the run had stopped right after it.
    first = storage.read_bytes(CheckpointStore(full).uri_for(1), 2**30)
    CheckpointStore(resumed).save_encoded(1, first)
    run(resumed)
    a, b = (CheckpointStore(root).load() for root in (full, resumed))
    assert a["epoch"] == b["epoch"] == 2
    for key in ("model_state", "optimizer_state", "scaler_state"):
        _assert_bitwise(a[key], b[key], key)


def _assert_bitwise(a: Any, b: Any, where: str) -> None:
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and torch.equal(a, b), f"{where} differs"
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for key in a:
            _assert_bitwise(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, list | tuple):
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _assert_bitwise(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def _charlm_job(tmp_path: Path, root: str, speed: SpeedSettings) -> Any:
    gen = torch.Generator().manual_seed(0)
    uris = []
    for name, rows in (("train", 48), ("val", 16)):
        uri = str(tmp_path / f"{name}.pt")
        storage.save_torch(uri, {"windows": torch.randint(0, 31, (rows, 9), generator=gen)})
        uris.append(uri)
    model = CharLSTMConfig(hidden_size=16, num_layers=2, dropout=0.1)
    return charlm_training.CharLMTrainJob(
        *uris, model, 2, 16, 0.01, 0, root, 3, RUN, log_every_steps=1, speed=speed
    )


@pytest.mark.timeout(120)
def test_charlm_fp32_resumes_bitwise(tmp_path) -> None:
    speed = SpeedSettings("auto", pin_memory=True)  # on CPU: fp32, pinning a no-op
    _assert_resume_is_exact(
        lambda root: _rank(charlm_training.train_rank, _charlm_job(tmp_path, root, speed)),
        tmp_path,
    )


@pytest.mark.timeout(120)
def test_charlm_bf16_resumes_bitwise_or_is_refused_before_training(tmp_path):
    logger = _Logger()
    speed = SpeedSettings("bf16")

    def run(root: str) -> Any:
        return _rank(charlm_training.train_rank, _charlm_job(tmp_path, root, speed), logger)

    try:
        run(str(tmp_path / "probe"))
    except SpeedError as error:
        # This machine's oneDNN has no bf16 LSTM: named, with the fix, and nothing written.
        assert "precision='bf16' does not run on this cpu" in str(error)
        assert "pass fp32 or auto" in str(error)
        assert CheckpointStore(str(tmp_path / "probe")).latest_uri() is None
        return
    assert '"precision": "bf16"' in logger.tags["ddpflow.speed"]
    _assert_resume_is_exact(run, tmp_path)


def _image_job(tmp_path: Path, root: str, speed: SpeedSettings) -> Any:
    gen = torch.Generator().manual_seed(0)
    uris = []
    # 32 px, not smaller: ResNet-18 then ends on 1x1 feature maps after a 2x2 input, and no
    # stride-2 convolution gets a 1x1 input. On CPUs with AVX-512 bf16 (Sapphire Rapids),
    # oneDNN's bf16 weight gradient of such a convolution reads uninitialised memory
    # (weights of 1e24 after a few steps, different in every run), in torch 2.14.
    for name, count in (("train", 8), ("val", 4)):
        uri = str(tmp_path / f"{name}.pt")
        images = torch.randint(0, 256, (count, 3, 32, 32), dtype=torch.uint8, generator=gen)
        storage.save_torch(uri, {"images": images, "labels": torch.arange(count) % 2})
        uris.append(uri)
    config = ImageModelConfig("resnet18", 2, 32, ("0", "1"))
    return vision_training.ImageTrainJob(
        *uris, config, None, 2, 4, 1e-3, "sgd", 0, 0, root, 3, RUN, speed=speed
    )


@pytest.mark.timeout(180)
@pytest.mark.parametrize(
    "speed",
    [SpeedSettings("fp32"), SpeedSettings("fp32", channels_last=True), SpeedSettings("bf16", True)],
    ids=["fp32", "channels_last", "bf16_channels_last"],
)
def test_images_resume_bitwise(tmp_path, speed: SpeedSettings) -> None:
    logger = _Logger()
    _assert_resume_is_exact(
        lambda root: _rank(vision_training.train_rank, _image_job(tmp_path, root, speed), logger),
        tmp_path,
    )
    resolved = logger.tags["ddpflow.speed"]
    assert f'"precision": "{speed.precision}"' in resolved
    assert f'"channels_last": {str(speed.channels_last).lower()}' in resolved


@pytest.mark.timeout(60)
def test_cpu_bf16_on_images_of_16_px_is_refused_before_training(tmp_path):
    """The oneDNN bug above: named, with the fix, before any checkpoint is read or written."""
    root = str(tmp_path / "checkpoints")
    job = _image_job(tmp_path, root, SpeedSettings("bf16", True))
    job = replace(job, model=replace(job.model, image_size=16))
    with pytest.raises(SpeedError, match="image_size=16 on CPU") as error:
        _rank(vision_training.train_rank, job)
    assert "pass image_size >= 17 or precision fp32" in str(error.value)
    assert CheckpointStore(root).latest_uri() is None
