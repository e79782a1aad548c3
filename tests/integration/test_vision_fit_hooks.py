"""fit()'s optional hooks (used by the image workload) and one image rank end to end."""

from __future__ import annotations

import io
from collections.abc import Mapping
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from PIL import Image
from torch import nn

from ddpflow.checkpoint.store import CheckpointStore
from ddpflow.distributed.context import RankContext, RankSpec, process_group
from ddpflow.tracking.loggers import RunRef
from ddpflow.training.context import TrainContext
from ddpflow.training.loop import FitHooks, FitPlan, fit_loop
from ddpflow.training.samples import TensorSamples
from ddpflow.workloads.vision.config import ImageModelConfig
from ddpflow.workloads.vision.data import ImageSpec, format_image_folder
from ddpflow.workloads.vision.job import ImageTrainJob
from ddpflow.workloads.vision.training import train_rank
from infra.procs import free_port

pytestmark = pytest.mark.integration

SINGLE = RankContext(rank=0, world_size=1, device=torch.device("cpu"), backend="none")


class Recorder:
    def __init__(self) -> None:
        self.metrics: list[tuple[int, dict[str, float]]] = []
        self.events: list[str] = []

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        self.metrics.append((step, dict(metrics)))

    def log_artifact(
        self, local_path: str, artifact_path: str | None = None, origin: str | None = None
    ) -> None:
        self.events.append(f"artifact {artifact_path}")

    def keep_artifacts(self, artifact_path, names) -> None:
        pass

    def set_tags(self, tags: Mapping[str, str]) -> None:
        pass


class Linear(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(2, 2)

    def forward(self, x, targets=None):
        logits = self.layer(x)
        return logits, F.cross_entropy(logits, targets) if targets is not None else None


def test_hooks_add_validation_step_metrics_and_an_epoch_end_before_the_checkpoint() -> None:
    torch.manual_seed(0)
    data = torch.randn(16, 2)
    logger = Recorder()
    model = Linear()

    def to_batch(index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return data[index], (data[index, 0] > 0).long()

    hooks = FitHooks(
        evaluate=lambda m: {"val_loss": 0.25, "val_accuracy": 0.75},
        step_metrics=lambda logits, y: {"train_accuracy": 1.0, "lr": 0.1},
        on_epoch_end=lambda stats: logger.events.append(f"end {stats.epoch} {stats.val_loss}"),
    )
    history = fit_loop(
        model=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        train=TensorSamples(torch.arange(16), to_batch),
        val=TensorSamples(torch.arange(4), to_batch),
        ctx=SINGLE,
        logger=logger,
        save_checkpoint=lambda epoch: logger.events.append(f"save {epoch}"),
        plan=FitPlan(epochs=2, batch_size=4, seed=0, log_every_steps=2),
        hooks=hooks,
    )
    assert logger.events == ["end 1 0.25", "save 1", "end 2 0.25", "save 2"]
    assert [h.val_metrics for h in history] == [{"val_accuracy": 0.75}] * 2
    steps = [(s, m) for s, m in logger.metrics if "train_loss" in m]
    assert [s for s, _ in steps] == [2, 4, 6, 8]
    assert all(m["train_accuracy"] == 1.0 and m["lr"] == 0.1 for _, m in steps)
    epochs = [(s, m) for s, m in logger.metrics if "val_loss" in m]
    assert [(s, m["val_accuracy"]) for s, m in epochs] == [(1, 0.75), (2, 0.75)]


def _png(value: int) -> bytes:
    buffer = io.BytesIO()
    Image.new("L", (8, 8), value).save(buffer, format="PNG")
    return buffer.getvalue()


@pytest.mark.timeout(120)
def test_one_image_rank_trains_logs_and_checkpoints_the_scheduler(tmp_path) -> None:
    for label, base in ((0, 20), (1, 230)):
        (tmp_path / "f" / str(label)).mkdir(parents=True)
        for i in range(6):
            (tmp_path / "f" / str(label) / f"{i}.png").write_bytes(_png(base + i))
    data = format_image_folder(
        str(tmp_path / "f"), str(tmp_path / "art"), ImageSpec(16), 0.34, 0, 0.0
    )
    logger = Recorder()
    config = ImageModelConfig("resnet18", 2, 16, ("0", "1"))
    root = str(tmp_path / "ckpt")
    job = ImageTrainJob(
        data.train_uri,
        data.val_uri,
        config,
        None,
        2,
        4,
        1e-3,
        "sgd",
        0,
        0,
        root,
        2,
        RunRef("unused", "unused"),
        log_every_steps=1,
    )
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with process_group(RankSpec(0, 1, "127.0.0.1", free_port(), "gloo", 60, "t")) as ctx:
            result = train_rank(TrainContext(ctx, job.train_settings(), logger), job)
    finally:
        torch.set_num_threads(threads)
    assert [h.epoch for h in result.history] == [1, 2]
    assert set(result.history[0].val_metrics) == {"val_accuracy"}
    state = torch.load(result.latest_checkpoint, weights_only=True)
    assert state["model_config"]["classes"] == ["0", "1"] and state["extra"]["lr"] == 1e-3
    assert state["scheduler_state"]["patience"] == 0
    assert state["scheduler_state"]["last_epoch"] == 2, "stepped once per epoch"
    assert logger.events == ["artifact checkpoints"] * 2, "each checkpoint is copied to MLflow"
    step_keys = {k for _, m in logger.metrics if "train_loss" in m for k in m}
    assert {"train_loss", "train_accuracy", "lr"} <= step_keys
    assert CheckpointStore(root).latest_uri().endswith("epoch-0002.pt")
    assert Path(result.latest_checkpoint).exists()


def test_fit_takes_its_arguments_by_name_only():
    """Ten positional parameters invite swapped arguments (train for val, say)."""
    with pytest.raises(TypeError, match="positional"):
        fit_loop(nn.Linear(2, 2), None)  # type: ignore[misc]
