"""Elastic both ways, for real: a LocalCluster of worker processes gains workers while a
ddpflow.run() training runs (cluster.scale), and loses one to SIGKILL.

The training (tests/helpers/grow_functions.py) is ddpflow.fit with a control step at
every step; each rank writes down the samples of every step, so the tests count what each
epoch trained on over all attempts.
"""

from __future__ import annotations

import os
import re
import signal
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import distributed
import pytest
import torch
from mlflow.tracking import MlflowClient

import ddpflow
from ddpflow.cluster.build import local_cluster
from ddpflow.distributed.supervisor.watch import cluster_workers
from ddpflow.tracking.run import FINAL_WORLD_SIZE_TAG, WORLD_SIZES_TAG
from tests.helpers.grow_functions import EPOCHS, SAMPLES, recorded_fit, samples_by_epoch

SETTLE_S = 5.0
WAIT_S = 120.0


def _wait_until(condition, what: str, timeout_s: float = WAIT_S) -> None:  # noqa: ANN001
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def _workers(client: distributed.Client) -> set[str]:
    return set(cluster_workers(client))


class _Timeline:
    """What the test's driver thread did and when, and what the training reported."""

    def __init__(self) -> None:
        self.stepping = threading.Event()
        self.resizes: list[ddpflow.Resize] = []
        self.resized_at: list[float] = []
        self.restarts: list[ddpflow.Restart] = []
        self.visit_s = float("nan")
        self.joined_at = float("nan")
        self.joiner = ""
        self.error: BaseException | None = None
        self.unpause_on_resize: Path | None = None
        self.steps_dir = Path()
        self.lines: list[str] = []

    def on_event(self, progress: ddpflow.Progress) -> None:
        if progress.step:
            self.stepping.set()
        if progress.line:
            self.lines.append(progress.line)

    def assert_resumes_count_one_world_size(self) -> None:
        """Each resume inside an epoch states its step and the epoch's steps at one size."""
        resumes = [
            re.search(r"step (\d+)/(\d+) at (\d+) rank", line)
            for line in self.lines
            if line.startswith("resuming at epoch") and "inside the epoch" in line
        ]
        assert resumes, self.lines
        for found in resumes:
            assert found and int(found[1]) <= int(found[2]), self.lines

    def on_resize(self, resize: ddpflow.Resize) -> None:
        self.resizes.append(resize)
        self.resized_at.append(time.monotonic())
        if self.unpause_on_resize is not None:
            self.unpause_on_resize.unlink(missing_ok=True)


def _join(cluster: distributed.LocalCluster, client: distributed.Client, n: int) -> str:
    """Scale to `n` workers and wait for the new one; its address."""
    before = _workers(client)
    cluster.scale(n)
    _wait_until(lambda: len(_workers(client)) == n, f"worker {n} to join")
    (joiner,) = _workers(client) - before
    return joiner


Script = Callable[[distributed.LocalCluster, distributed.Client, "_Timeline"], None]


@contextmanager
def _cluster_driven_by(script: Script, line: _Timeline) -> Iterator[distributed.Client]:
    """A LocalCluster of 2 and its client, while `script(cluster, client, line)` runs in a
    thread beside the test's training; an error there is kept in `line.error`."""

    def drive(cluster: distributed.LocalCluster, client: distributed.Client) -> None:
        try:
            script(cluster, client, line)
        except BaseException as error:  # noqa: BLE001 - reported by the test's thread
            line.error = error

    with local_cluster(2) as cluster, distributed.Client(cluster) as client:
        client.wait_for_workers(2, timeout=60)
        driver = threading.Thread(target=drive, args=(cluster, client))
        driver.start()
        try:
            yield client
        finally:
            driver.join(timeout=WAIT_S)


def _join_and_stay(
    cluster: distributed.LocalCluster, client: distributed.Client, line: _Timeline
) -> None:
    """Once the training steps (the first time; a later call, at once): a third worker
    joins, and stays."""
    assert line.stepping.wait(WAIT_S), "the training never stepped"
    line.joiner = _join(cluster, client, 3)
    line.joined_at = time.monotonic()


def _visit_then_stay(
    cluster: distributed.LocalCluster, client: distributed.Client, line: _Timeline
) -> None:
    """Once the training steps: a third worker joins and leaves at once (within the settle
    time), then another joins and stays."""
    assert line.stepping.wait(WAIT_S), "the training never stepped"
    _join(cluster, client, 3)
    arrived = time.monotonic()
    cluster.scale(2)
    _wait_until(lambda: len(_workers(client)) == 2, "the visitor to leave")
    line.visit_s = time.monotonic() - arrived
    time.sleep(1.0)
    _join_and_stay(cluster, client, line)


def _run(client: distributed.Client, tmp_path: Path, line: _Timeline, *more, **kwargs) -> dict:  # noqa: ANN002, ANN003
    steps = tmp_path / "steps"
    steps.mkdir()
    line.steps_dir = steps
    pause = tmp_path / "pause"
    pause.touch()
    return ddpflow.run(
        client,
        recorded_fit,
        str(steps),
        str(pause),
        *more,
        min_workers=2,
        max_workers=3,
        settle_s=SETTLE_S,
        checkpoint_dir=str(tmp_path / "checkpoints"),
        tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}",
        experiment="grow",
        on_event=line.on_event,
        on_resize=line.on_resize,
        **kwargs,
    )


def _the_run(tmp_path: Path) -> tuple[MlflowClient, str]:
    mlflow = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    (experiment,) = [e for e in mlflow.search_experiments() if e.name == "grow"]
    runs = mlflow.search_runs([experiment.experiment_id])
    assert len(runs) == 1, "one MLflow run over every attempt"
    return mlflow, runs[0].info.run_id


def _assert_each_sample_once_per_epoch(tmp_path: Path) -> None:
    epochs = samples_by_epoch(str(tmp_path / "steps"))
    assert len(epochs) == EPOCHS
    for number, seen in enumerate(epochs, start=1):
        assert sorted(seen) == list(range(SAMPLES)), f"epoch {number}: each sample exactly once"


# docs/fault-tolerance.md "Growing": a worker that joins and stays the settle time grows the
# group at the next step checkpoint; one that leaves within it changes nothing.
def test_a_worker_that_joins_and_stays_grows_the_group_one_that_visits_does_not(tmp_path):
    line = _Timeline()
    line.unpause_on_resize = tmp_path / "pause"  # the rest at full speed
    with _cluster_driven_by(_visit_then_stay, line) as client:
        # max_restarts=0: a grow that spent a restart would fail the run.
        finished = _run(client, tmp_path, line, max_restarts=0, on_restart=line.restarts.append)
    assert line.error is None, line.error
    assert line.visit_s < SETTLE_S, "the visitor stayed too long for this test to mean anything"
    assert finished["world_size"] == 3
    assert [(r.old_size, r.new_size, r.reason, r.workers) for r in line.resizes] == [
        (2, 3, "joined", [line.joiner])
    ], "the visitor caused no relaunch; the worker that stayed, one"
    assert line.restarts == []
    # Relaunched within the settle time plus one control step (every step here) and the
    # watch's look (1 s); the rest is slack for a loaded 2-core machine.
    assert line.resized_at[0] - line.joined_at < SETTLE_S + 15
    mlflow, run_id = _the_run(tmp_path)
    sizes = mlflow.get_metric_history(run_id, "world_size")
    assert [m.value for m in sorted(sizes, key=lambda m: m.step)] == [2.0, 3.0]
    tags = mlflow.get_run(run_id).data.tags
    assert (tags[FINAL_WORLD_SIZE_TAG], tags[WORLD_SIZES_TAG]) == ("3", "2 → 3")
    line.assert_resumes_count_one_world_size()
    logged = [m.step for m in mlflow.get_metric_history(run_id, "train_loss")]
    assert sorted(logged) == list(range(1, max(logged) + 1)), "each training step logged once"
    _assert_each_sample_once_per_epoch(tmp_path)


def _grow_then_kill(
    cluster: distributed.LocalCluster, client: distributed.Client, line: _Timeline
) -> None:
    """A third worker joins and stays; a few steps after the group grew, it is SIGKILLed
    with its nanny closing (a lost host): nothing replaces it."""
    _join_and_stay(cluster, client, line)
    _wait_until(lambda: line.resizes, "the group to grow")
    # Past a step checkpoint at 3 ranks (one every 5 steps), so the larger size is on
    # record before the kill: rank 2 writes a line per step.
    _wait_until(
        lambda: any(
            len(p.read_text().splitlines()) >= 8 for p in line.steps_dir.glob("*-rank2.jsonl")
        ),
        "8 steps at 3 ranks",
    )
    (nanny,) = [n for n in cluster.workers.values() if n.worker_address == line.joiner]
    pid = client.run(os.getpid, workers=[line.joiner])[line.joiner]
    nanny.close_gracefully()  # it will not start a new worker process
    os.kill(pid, signal.SIGKILL)


def test_grow_then_lose_goes_on_at_the_smaller_size_with_each_sample_once(tmp_path):
    line = _Timeline()

    def restarted(restart: ddpflow.Restart) -> None:
        line.restarts.append(restart)
        (tmp_path / "pause").unlink(missing_ok=True)

    with _cluster_driven_by(_grow_then_kill, line) as client:
        finished = _run(client, tmp_path, line, max_restarts=1, on_restart=restarted)
    assert line.error is None, line.error
    assert finished["world_size"] == 2
    assert [(r.old_size, r.new_size, r.reason) for r in line.resizes] == [
        (2, 3, "joined"),
        (3, 2, "lost"),
    ]
    assert len(line.restarts) == 1, "the kill spent the one restart; the grow none"
    # The joiner is lost for good. A rank of the failed group that still ran on an original
    # worker gets that worker restarted by the launcher (its nanny brings it back at a new
    # address), so it may be listed as lost too, with its replacement among the new workers.
    lost = line.resizes[1].workers
    assert line.joiner in lost
    assert len(lost) - len(line.restarts[0].new_workers) == 1, "one worker lost for good"
    mlflow, run_id = _the_run(tmp_path)
    sizes = sorted(mlflow.get_metric_history(run_id, "world_size"), key=lambda m: m.step)
    assert [m.value for m in sizes] == [2.0, 3.0, 2.0]
    tags = mlflow.get_run(run_id).data.tags
    assert (tags[FINAL_WORLD_SIZE_TAG], tags[WORLD_SIZES_TAG]) == ("2", "2 → 3 → 2")
    line.assert_resumes_count_one_world_size()
    _assert_each_sample_once_per_epoch(tmp_path)


# docs/fault-tolerance.md "Growing": with a global batch, the steps and their samples do not
# depend on the world size, so a group that grew trains the model of a group that did not.
def test_with_a_global_batch_a_grown_training_ends_with_the_weights_of_one_on_3_ranks(tmp_path):
    line = _Timeline()
    line.unpause_on_resize = tmp_path / "pause"
    with _cluster_driven_by(_join_and_stay, line) as client:
        grown = _run(client, tmp_path, line, True, max_restarts=0)
        steps = tmp_path / "straight-steps"
        steps.mkdir()
        straight = ddpflow.run(
            client,
            recorded_fit,
            str(steps),
            str(tmp_path / "no-pause"),
            True,
            world_size=3,
            checkpoint_dir=str(tmp_path / "straight-checkpoints"),
        )
    assert line.error is None, line.error
    assert [(r.old_size, r.new_size) for r in line.resizes] == [(2, 3)]
    assert grown["world_size"] == straight["world_size"] == 3
    # Equal up to the order in which gloo sums the ranks' gradients.
    for mine, theirs in zip(grown["weights"], straight["weights"], strict=True):
        torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-6)
    _assert_each_sample_once_per_epoch(tmp_path)


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [
        ({"max_workers": 0}, "max_workers=0"),
        ({"world_size": 2, "max_workers": 1}, "world_size=2 is more than max_workers=1"),
        ({"min_workers": 3, "max_workers": 2}, "min_workers=3 is more than max_workers=2"),
        ({"max_workers": 3, "settle_s": -1}, "settle_s=-1"),
    ],
)
def test_bad_world_bounds_are_named_before_any_rank_starts(dask_client, tmp_path, kwargs, named):
    with pytest.raises(ValueError, match=named):
        ddpflow.run(dask_client, recorded_fit, str(tmp_path), str(tmp_path / "pause"), **kwargs)
    assert not list(tmp_path.iterdir()), "nothing ran"
