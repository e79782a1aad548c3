"""A few rows of tests/unit/test_bad_inputs.py through `python -m flows.<name>`, as a user
runs them: each exits 1 with one line naming the input and the fix, and nothing the
project already stored changes. The image folder row holds a FIFO, a link to /dev/zero and
a link out of the folder: the real listing must name all three within 2 minutes."""

from __future__ import annotations

import os
from datetime import datetime
from pathlib import Path

import pytest

from ddpflow.training.batching import MAX_SEED
from infra.services import free_port
from tests.integration.conftest import run_flow
from tests.pngs import png

pytestmark = pytest.mark.integration
# One worker is enough to reach the checks; a loaded machine needs longer than Prefect's
# default 20 s to start its temporary API server.
ENV = {"DDPFLOW_DASK_WORKERS": "1", "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "90"}


def _stored(project: Path) -> dict[str, tuple[int, int]]:
    return {
        str(p.relative_to(project)): (p.stat().st_size, p.stat().st_mtime_ns)
        for p in project.rglob("*")
        if p.is_file() and p.relative_to(project).parts[0] in ("artifacts", "mlflow.db")
    }


@pytest.fixture
def project(tmp_path: Path) -> Path:
    """A project that already stores a run's checkpoint and an MLflow database file."""
    (tmp_path / "artifacts" / "runs" / "r1").mkdir(parents=True)
    (tmp_path / "artifacts" / "runs" / "r1" / "latest.json").write_text('{"epoch": 3}')
    (tmp_path / "mlflow.db").write_bytes(b"SQLite format 3\0 stand-in")
    return tmp_path


def _fails_naming(
    module: str,
    args: list[str],
    project: Path,
    *expected: str,
    env: dict[str, str] | None = None,
) -> str:
    """Run the flow, check its failure line and the store; return its stderr."""
    before = _stored(project)
    # Generous: Prefect's API server and the Dask cluster alone take a minute when other
    # work shares the 2 cores; the flow's own time is checked where it matters.
    result = run_flow(module, args, project, timeout_s=300, env={**ENV, **(env or {})})
    assert result.returncode == 1, result.stdout[-3000:] + result.stderr[-3000:]
    # The CLI's one line; Prefect's shutdown logs may follow it.
    lines = [line for line in result.stderr.splitlines() if line.startswith("ddpflow: ")]
    assert lines and "failed" in lines[-1], result.stderr[-3000:]
    last = lines[-1]
    for text in expected:
        assert text in last, last
    assert _stored(project) == before, "nothing stored changed"
    return result.stderr


def _flow_seconds(stderr: str) -> float:
    """From Prefect's 'Beginning flow run' log line to its 'Finished in state' line."""
    stamps = {}
    for line in stderr.splitlines():
        for mark in ("Beginning flow run", "Finished in state"):
            if mark in line and "Flow run" in line:
                stamps[mark] = datetime.strptime(line.split(" ", 1)[0], "%H:%M:%S.%f")
    return (stamps["Finished in state"] - stamps["Beginning flow run"]).total_seconds()


def test_train_charlm_rejects_an_infinite_rank_timeout(project: Path) -> None:
    _fails_naming(
        "train_charlm", ["--rank-timeout-s", "inf"], project, "rank_timeout_s='inf'", "e.g. 120"
    )


def test_sweep_rejects_a_seed_that_overflows_the_generator(project: Path) -> None:
    seed = str(MAX_SEED + 1)
    _fails_naming(
        "sweep_charlm", ["--seed", seed], project, f"seed='{seed}'", f"from 0 to {MAX_SEED}"
    )


# docs/s3-and-servers.md "Pre-flight": stops an unreachable cluster before any work. (The
# store and tracking rows of pre-flight are in tests/unit/test_bad_inputs.py, test_s3.py.)
def test_unreachable_dask_address_stops_the_flow_before_any_task(project: Path) -> None:
    address = f"tcp://127.0.0.1:{free_port()}"  # nothing listens there
    stderr = _fails_naming(
        "train_charlm",
        ["--epochs", "1"],
        project,
        f"Dask scheduler {address} is not reachable",
        "Start it or fix DDPFLOW_DASK_ADDRESS",
        env={"DDPFLOW_DASK_ADDRESS": address},
    )
    # Pre-flight is the flow's first step: no task (download, format, train) ever ran.
    assert "Task run" not in stderr, stderr[-3000:]


def test_train_images_names_fifo_dev_zero_and_escaping_link(project: Path) -> None:
    root = project / "inputs" / "images"
    for label in ("cat", "dog"):
        (root / label).mkdir(parents=True)
        for i in range(4):
            (root / label / f"{i}.png").write_bytes(png(30 * i + 5))
    os.mkfifo(root / "cat" / "fifo.png")
    os.symlink("/dev/zero", root / "cat" / "zero.png")
    (project / "inputs" / "private.png").write_bytes(png(1))
    os.symlink(project / "inputs" / "private.png", root / "dog" / "escape.png")
    args = ["--source", str(root), "--max-bad-fraction", "0", "--image-size", "8"]
    keys = ("cat/fifo.png", "cat/zero.png", "dog/escape.png")
    stderr = _fails_naming(
        "train_images", args, project, *(str(root / k) for k in keys), "raise max_bad_fraction"
    )
    assert _flow_seconds(stderr) < 120, "cluster start, listing and the refusal"
