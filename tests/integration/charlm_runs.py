"""Tiny pet-name trainings shared by the fault tests: arguments, waits and weight checks."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import torch

from ddpflow.checkpoint import CheckpointStore

EPOCHS = 4
TINY = [
    "--epochs",
    str(EPOCHS),
    "--hidden-size",
    "32",
    "--num-layers",
    "1",
    "--batch-size",
    "1024",
    "--lr",
    "0.01",
    "--num-names",
    "3",
    "--keep-last",
    "10",
]


def wait_for_checkpoint(project: Path, epoch: int, proc: subprocess.Popen, timeout_s=180) -> None:
    deadline = time.monotonic() + timeout_s
    pattern = f"artifacts/runs/*/checkpoints/epoch-{epoch:04d}.pt"
    while not list(project.glob(pattern)):
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert time.monotonic() < deadline, f"no checkpoint of epoch {epoch}"
        time.sleep(0.1)


def finish(proc: subprocess.Popen, timeout_s: float = 300) -> tuple[int, str]:
    out, err = proc.communicate(timeout=timeout_s)
    return proc.returncode, out + err


def final_weights(project: Path) -> dict[str, torch.Tensor]:
    store = CheckpointStore(str(next((project / "artifacts" / "runs").iterdir()) / "checkpoints"))
    for uri in store.list_uris():  # every checkpoint loads
        torch.load(uri, weights_only=True)
    state = store.load()
    assert state["epoch"] == EPOCHS
    return state["model_state"]


def assert_same_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), f"{key} differs from the uninterrupted run"
