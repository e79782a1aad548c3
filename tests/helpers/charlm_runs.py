"""Tiny pet-name trainings shared by the fault tests: arguments, waits and weight checks."""

from __future__ import annotations

import concurrent.futures
import hashlib
import json
import os
import re
import subprocess
import tempfile
import time
from pathlib import Path

import httpx
import torch
from mlflow.entities import Run
from mlflow.tracking import MlflowClient

from ddpflow.checkpoint.store import POINTER_NAME, CheckpointStore, read_pointer
from ddpflow.workloads.charlm.corpus import DEFAULT_CORPUS_PATH

EPOCHS = 3
SMALL_CORPUS_NAMES = 8_000


def small_corpus(num_names: int = SMALL_CORPUS_NAMES) -> Path:
    """The shipped corpus's first `num_names` names in a file every test process shares. With
    the default (about a sixth), an epoch of a 2-rank tiny training takes about 1.5 s instead
    of 9 s, and the two epochs after the first checkpoint are still long enough to kill,
    stop or cut off a worker mid-run: with 16,000 names the fault-tolerance module cost 424
    CPU-seconds, with 8,000 372 (multi-host 326 and 308, the outages 164 and 144), every
    test passing (bench.suite_cost --per-module, 2026-12-07)."""
    corpus = DEFAULT_CORPUS_PATH.read_bytes()
    digest = hashlib.sha256(corpus).hexdigest()[:12]
    path = Path(tempfile.gettempdir()) / f"ddpflow-test-names-{num_names}-{digest}.json"
    if not path.exists():
        names = json.loads(corpus)[:num_names]
        partial = path.with_name(f"{path.name}.{os.getpid()}")
        partial.write_text(json.dumps(names))
        os.replace(partial, path)  # concurrent test processes write the same bytes
    return path


# A test's training reads these names unless what it tests is the shipped corpus itself: the
# full corpus made each tiny run 7 (one epoch) to 11 (three) CPU-seconds dearer.
SMALL_SOURCE = str(small_corpus())
# Twice the names: at a batch of 2048 an epoch of 2 ranks then has more than the 20 steps
# after which fit() logs its per-step metrics, which the deployment and sweep tests read.
STEPPED_SOURCE = str(small_corpus(16_000))

# Two layers with dropout: the LSTM draws dropout masks between its layers, so a resume is
# exact only if the RNG is reseeded per step (one layer would draw nothing at all).
# As the flow's parameter model takes it (a flow run in-process); TINY: on the command line.
TINY_PARAMS: dict[str, object] = {
    "source": SMALL_SOURCE,
    "epochs": EPOCHS,
    "hidden_size": 32,
    "num_layers": 2,
    "dropout": 0.1,
    "batch_size": 1024,
    "lr": 0.01,
    "num_names": 3,
    "keep_last": 10,
}
TINY = [arg for k, v in TINY_PARAMS.items() for arg in (f"--{k.replace('_', '-')}", str(v))]


def wait_for_checkpoint(
    project: Path,
    epoch: int,
    proc: subprocess.Popen | concurrent.futures.Future,
    timeout_s=300,
    step: bool = False,
) -> None:
    """Until the checkpoint after `epoch` epochs is complete; step=True: one inside the
    next epoch (a step checkpoint, epoch-NNNN.step-SSSSSSSS.pt). `proc` is the flow: a
    process, or a flow run in a thread of this process (start_in_process); it must not end
    first.

    Complete: the run's latest.json names it, or a later one. Rank 0 moves that pointer
    only after the file is written, and a relaunch resumes from what it names: a rank
    stopped between the two writes resumes from the checkpoint before (a hung-worker test
    once stopped it there, and saw the run start over)."""
    deadline = time.monotonic() + timeout_s
    # Checkpoint names sort in training order (ddpflow.checkpoint.store).
    wanted = f"epoch-{epoch:04d}" + (".step-" if step else ".pt")
    while not any(name >= wanted for name in latest_checkpoint_names(project)):
        if isinstance(proc, concurrent.futures.Future):
            assert not proc.done(), f"the flow ended first: {proc.result()}"
        else:
            assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert time.monotonic() < deadline, f"no checkpoint of epoch {epoch}"
        time.sleep(0.1)


def latest_checkpoint_names(project: Path) -> list[str]:
    """The file name each run's latest.json names, read as a resume reads it (none while it
    is being written)."""
    names = []
    for pointer in project.glob(f"artifacts/runs/*/checkpoints/{POINTER_NAME}"):
        try:
            names.append(read_pointer(str(pointer)).rsplit("/", 1)[-1])
        except (OSError, ValueError):
            continue
    return names


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


def the_run(project: Path) -> tuple[MlflowClient, Run]:
    """The project's one training run (the flow's default experiment, a SQLite store)."""
    client = MlflowClient(f"sqlite:///{project / 'mlflow.db'}")
    runs = client.search_runs([client.get_experiment_by_name("ddpflow-charlm").experiment_id])
    assert len(runs) == 1, "one training, one MLflow run"
    return client, runs[0]


def metric_points(project: Path, key: str) -> list[tuple[int, float]]:
    """(step, value) of every point the project's run logged for `key`, by step."""
    client, run = the_run(project)
    return sorted((m.step, m.value) for m in client.get_metric_history(run.info.run_id, key))


def assert_same_metrics(project: Path, reference: Path) -> None:
    """Every step of the uninterrupted run is there exactly once, none missing, none extra,
    with the same value (the resume is exact, so the losses are too)."""
    for key in ("train_loss", "val_loss", "epoch_train_loss"):
        points, expected = metric_points(project, key), metric_points(reference, key)
        assert expected, f"the reference logged no {key}"
        assert [s for s, _ in points] == [s for s, _ in expected], f"{key}: steps differ"
        assert points == expected, f"{key}: values differ from the uninterrupted run"


def assert_same_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), f"{key} differs from the uninterrupted run"


def assert_completed_once_with_one_restart(project: Path, output: str) -> None:
    """The project's run finished after exactly one restart, each epoch's metric once and no
    re-run step logged twice (`output`, the flow's log, explains a failure)."""
    client, run = the_run(project)
    assert run.info.status == "FINISHED"
    assert run.data.tags["ddpflow.restarts"] == "1", output[-3000:]
    steps = [m.step for m in client.get_metric_history(run.info.run_id, "val_loss")]
    assert sorted(steps) == list(range(1, EPOCHS + 1)), "each epoch's metric exactly once"
    steps = [m.step for m in client.get_metric_history(run.info.run_id, "train_loss")]
    assert steps and len(steps) == len(set(steps)), "the re-run steps are not logged twice"


def restart_rows(prefect_url: str, run_id: str) -> list[list[str]]:
    """The rows of the `charlm-restarts` artifact that names `run_id`, on the Prefect API at
    `prefect_url`.

    Read over the REST API: `prefect artifact inspect` renders through rich, which fails on
    the bracketed gloo source paths a restart cause can quote."""
    # Newest first: the test process's API holds the restarts of every module before.
    restarts = {"key": {"any_": ["charlm-restarts"]}}
    body = {"artifacts": restarts, "sort": "CREATED_DESC", "limit": 50}
    response = httpx.post(f"{prefect_url}/artifacts/filter", json=body, timeout=30)
    response.raise_for_status()
    mine = [a["data"] for a in response.json() if f"MLflow run `{run_id}`" in a["data"]]
    assert len(mine) == 1, f"one restarts artifact for run {run_id}, found {len(mine)}"
    rows = [line for line in mine[0].splitlines() if re.match(r"\|\s*\d+\s*\|", line)]
    return [[cell.strip() for cell in row.strip().strip("|").split("|")] for row in rows]


def process_gone(pid: int, timeout_s: float) -> bool:
    """The process exited within `timeout_s` (a zombie its nanny has not reaped counts)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (ProcessLookupError, FileNotFoundError):
            return True
        if state == "Z":
            return True
        time.sleep(0.1)
    return False
