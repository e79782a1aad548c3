"""A few rows of tests/unit/test_bad_inputs.py through the command line's own code
(`flows.cli.run_cli`: its option parser and its failure line), as `python -m flows.<name>`
runs them, on the module's shared Prefect API and Dask cluster (flow_services): each exits 1
with one line naming the input and the fix, and nothing the project already stored changes.
The image folder row holds a FIFO, a link to /dev/zero and a link out of the folder: the
real listing must name all three within 2 minutes.

The entry point around run_cli (the early Prefect API, the LocalCluster a command line
starts) is run as a real process in test_embedded_api_start.py and
test_train_charlm_flow.py; a failure costs 20 s there against 2 s here."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from ddpflow.training.batching import MAX_SEED
from flows.sweep_charlm import sweep_charlm
from flows.train_charlm import train_charlm
from flows.train_images import train_images
from infra.services import free_port
from tests.helpers.in_process import cli_exit_code
from tests.helpers.pngs import png
from tests.helpers.prefect_reads import flow_run_task_runs, latest_flow_run, own_tag

pytestmark = pytest.mark.integration


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


@pytest.fixture
def fails_naming(flow_services: str, monkeypatch, capsys):
    """Run the flow's command line in the project, check its failure line and the store;
    return the flow run as the API recorded it, and the names of its task runs."""

    def run(
        flow: Any,
        args: list[str],
        project: Path,
        *expected: str,
        address: str = flow_services,
    ) -> Any:
        before = _stored(project)
        capsys.readouterr()
        with own_tag() as tag:  # this run's, in an API other processes share
            code = cli_exit_code(flow, args, project, address, monkeypatch)
        stderr = capsys.readouterr().err
        assert code == 1, stderr[-3000:]
        lines = [line for line in stderr.splitlines() if line.startswith("ddpflow: ")]
        assert lines and "failed" in lines[-1], stderr[-3000:]
        last = lines[-1]
        for text in expected:
            assert text in last, last
        assert _stored(project) == before, "nothing stored changed"
        flow_run = latest_flow_run(flow.name, tag)
        return flow_run, [task.name for task in flow_run_task_runs(flow_run.id)]

    return run


def test_train_charlm_rejects_an_infinite_rank_timeout(project: Path, fails_naming) -> None:
    fails_naming(
        train_charlm,
        ["--rank-timeout-s", "inf"],
        project,
        "rank_timeout_s='inf': Input should be a finite number",
    )


def test_sweep_rejects_a_seed_that_overflows_the_generator(project: Path, fails_naming) -> None:
    seed = str(MAX_SEED + 1)
    bound = f"seed='{seed}': Input should be less than or equal to {MAX_SEED}"
    fails_naming(sweep_charlm, ["--seed", seed], project, bound)


# docs/s3-and-servers.md "Pre-flight": stops an unreachable cluster before any work. (The
# store and tracking rows of pre-flight are in tests/unit/test_bad_inputs.py, test_s3.py.)
def test_unreachable_dask_address_stops_the_flow_before_any_task(
    project: Path, fails_naming
) -> None:
    address = f"tcp://127.0.0.1:{free_port()}"  # nothing listens there
    run, task_names = fails_naming(
        train_charlm,
        ["--epochs", "1"],
        project,
        f"Dask scheduler {address} is not reachable",
        "Start it or fix DDPFLOW_DASK_ADDRESS",
        address=address,
    )
    # Pre-flight is the flow's first step: no task (download, format, train) ever ran.
    assert run.state.is_failed() and task_names == [], (run.state, task_names)


def test_train_images_names_fifo_dev_zero_and_escaping_link(project: Path, fails_naming) -> None:
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
    run, _ = fails_naming(
        train_images, args, project, *(str(root / k) for k in keys), "raise max_bad_fraction"
    )
    assert run.total_run_time.total_seconds() < 120, "listing and the refusal"
