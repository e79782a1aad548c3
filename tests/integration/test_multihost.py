"""DDP across hosts: network namespaces on a bridge, one Dask worker per host.

The cluster, its servers and what each host runs are described in infra/netns_cluster.py.
Every flow runs on the head node (the root namespace) with the servers' bridge addresses in
its environment and nothing on the workers but the S3 keys: in a thread of this process, with
the cluster's Prefect server as this process's API, and as a user runs it (`python -m
flows.train_charlm`) where what is tested is that command's own embedded Prefect API.
"""

from __future__ import annotations

import concurrent.futures
import os
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import distributed
import httpx
import pytest
from mlflow.tracking import MlflowClient

import ddpflow
from ddpflow.distributed.launcher import RANK_KEY_PREFIX
from ddpflow.distributed.supervisor.relaunch import launch_with_restarts
from ddpflow.storage import url_to_fs
from ddpflow.workloads.vision.digits import digits_pngs
from flows.params import CharLMParams, ImageParams
from flows.train_charlm import train_charlm
from flows.train_images import train_images
from infra import netns
from tests.helpers.charlm_runs import (
    EPOCHS,
    TINY,
    TINY_PARAMS,
    assert_same_weights,
    final_weights,
    finish,
    wait_for_checkpoint,
)
from tests.helpers.grow_functions import EPOCHS as GROW_EPOCHS
from tests.helpers.grow_functions import SAMPLES, recorded_fit, samples_by_epoch
from tests.helpers.in_process import (
    cli_exit_code,
    finish_in_process,
    run_in_process,
    start_in_process,
)
from tests.helpers.multihost import (
    BUCKET,
    MultiHost,
    loopback_forwarder,
    multihost_cluster,
)
from tests.helpers.paths import CHECKOUT
from tests.helpers.prefect_harness import api_of_this_process
from tests.helpers.prefect_reads import latest_flow_run
from tests.helpers.projects import project_env
from tests.helpers.rank_functions import advertise_loopback_once, started_at, stuck_once
from tests.helpers.s3_servers import s3_env

pytestmark = [pytest.mark.integration, pytest.mark.multihost]
# A cut-off host's rank makes rank 0's collective wait this long before the group fails.
RANK_TIMEOUT_S = 20.0
# Each step's sleep while the grow test waits for host c: its namespace, worker and settle
# time took over the 30 s that 0.2 s a step gave on a loaded CI machine (stop 75), and the
# training ended ungrown. 1 s a step leaves about 150 s; sleeping costs no CPU, and the
# steps after the grow run at full speed.
HOST_C_PAUSE_S = 1.0


@pytest.fixture(scope="module")
def multi(tmp_path_factory) -> Iterator[MultiHost]:
    reason = netns.can_make_namespaces()
    if reason:
        if os.environ.get("CI") == "true":
            pytest.fail(f"multi-host tests must run in CI: {reason}")
        pytest.skip(reason)
    with multihost_cluster(tmp_path_factory.mktemp("multihost")) as cluster:
        yield cluster


@pytest.fixture
def restored(multi) -> Iterator[MultiHost]:
    """Each test starts with every host connected and both workers registered; the cluster's
    Prefect server is this process's API meanwhile."""
    multi.restore()
    with api_of_this_process(multi.prefect_url):
        yield multi
    multi.restore()


def start_flow(
    multi: MultiHost, project: Path, monkeypatch, env: dict[str, str] | None = None, **overrides
) -> concurrent.futures.Future:
    """The tiny training (TINY_PARAMS with `overrides`) in a thread, on the cluster."""
    full_env = {**multi.flow_env(str(project / "artifacts")), **(env or {})}
    training = CharLMParams(**{**TINY_PARAMS, **overrides})
    address = multi.scheduler_address
    return start_in_process(
        train_charlm, project, address, monkeypatch, full_env, training=training
    )


def start_command(
    multi: MultiHost, project: Path, env: dict[str, str] | None = None
) -> subprocess.Popen[str]:
    """`python -m flows.train_charlm` with the tiny arguments, as a user on the head node."""
    project.mkdir(parents=True, exist_ok=True)
    full_env = {**project_env(project), **multi.flow_env(str(project / "artifacts"))}
    return subprocess.Popen(
        [sys.executable, "-m", "flows.train_charlm", *TINY],
        cwd=project,
        env={**full_env, **(env or {}), "PYTHONPATH": str(CHECKOUT)},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def the_run(multi: MultiHost, run_id: str):
    client = MlflowClient(multi.mlflow_url)
    return client, client.get_run(run_id)


def run_id_of(project: Path) -> str:
    (run_dir,) = (project / "artifacts" / "runs").iterdir()
    return run_dir.name


def assert_one_run_one_restart(multi: MultiHost, project: Path, output: str) -> dict[str, str]:
    client, run = the_run(multi, run_id_of(project))
    assert run.info.status == "FINISHED", output[-3000:]
    assert run.data.tags["ddpflow.restarts"] == "1", output[-3000:]
    steps = [m.step for m in client.get_metric_history(run.info.run_id, "val_loss")]
    assert sorted(steps) == list(range(1, EPOCHS + 1)), "each epoch's metric exactly once"
    steps = [m.step for m in client.get_metric_history(run.info.run_id, "train_loss")]
    assert steps and len(steps) == len(set(steps)), "no step logged twice"
    return run.data.tags


def test_two_ranks_on_two_hosts_equal_two_ranks_on_one_host(
    restored, charlm_reference, tmp_path, monkeypatch
):
    with restored.client() as client:
        hosts = {restored.worker_on(client, h) for h in ("a", "b")}
    assert len(hosts) == 2, "one worker on each host"
    flow_run = start_flow(restored, tmp_path, monkeypatch)
    state, output = finish_in_process(flow_run, "world size ", timeout_s=400)
    assert state.is_completed(), f"{state}\n{output[-4000:]}"
    assert "world size         2 ranks" in output
    assert_same_weights(final_weights(tmp_path), charlm_reference)


def partition_after_epoch_1(
    multi: MultiHost, project: Path, flow_run: concurrent.futures.Future, host: str
) -> None:
    wait_for_checkpoint(project, 1, flow_run, timeout_s=300)
    multi.hosts.partition(host)


def test_a_host_cut_off_mid_run_costs_one_restart_and_is_used_again(
    restored, tmp_path, monkeypatch
):
    """Host b's link goes down in epoch 2 for longer than Dask's 30 s TCP timeout, so its
    worker is dropped and exits; when the link is back its supervisor starts it again and
    the run resumes from the latest checkpoint on both hosts."""
    flow_run = start_flow(restored, tmp_path, monkeypatch, rank_timeout_s=RANK_TIMEOUT_S)
    partition_after_epoch_1(restored, tmp_path, flow_run, "b")
    cut_at = time.monotonic()
    reconnect = threading.Timer(40, restored.hosts.reconnect, ("b",))
    reconnect.start()
    try:
        state, output = finish_in_process(flow_run, "resuming after epoch ", timeout_s=400)
    finally:
        reconnect.cancel()
    assert state.is_completed(), f"{state}\n{output[-4000:]}"
    tags = assert_one_run_one_restart(restored, tmp_path, output)
    assert time.monotonic() - cut_at > 40, "the run waited for the host instead of going on"
    assert "resuming after epoch " in output
    # Whichever notices first is the cause: rank 0's collective with the cut-off peer, or
    # the step watchdog, to which rank 1's worker no longer answers.
    cause = tags["ddpflow.restart.1.cause"]
    assert re.search(r"rank [01] on worker tcp://10\.", cause), cause
    assert_ranks_after_restart(restored, 2)


def test_a_host_that_stays_away_leaves_the_run_to_the_others(restored, tmp_path, monkeypatch):
    """With min_workers=1, a host that does not come back within the heal timeout is given
    up: the run finishes on the host that is left."""
    heal = {"DDPFLOW_HEAL_TIMEOUT_S": "30"}
    flow_run = start_flow(
        restored, tmp_path, monkeypatch, heal, rank_timeout_s=RANK_TIMEOUT_S, min_workers=1
    )
    partition_after_epoch_1(restored, tmp_path, flow_run, "b")
    state, output = finish_in_process(flow_run, timeout_s=400)
    assert state.is_completed(), f"{state}\n{output[-4000:]}"
    assert_one_run_one_restart(restored, tmp_path, output)
    assert_ranks_after_restart(restored, 1)


def assert_ranks_after_restart(multi: MultiHost, world_size: int) -> None:
    """The restarts artifact (in the flow's Prefect server) records the relaunch's size.

    Read over the REST API: `prefect artifact inspect` renders the artifact through rich,
    which fails on the gloo source paths in brackets that the restart cause quotes."""
    body = {"artifacts": {"key": {"any_": ["charlm-restarts"]}}, "sort": "UPDATED_DESC"}
    response = httpx.post(f"{multi.prefect_url}/artifacts/filter", json={**body, "limit": 1})
    response.raise_for_status()
    (newest,) = response.json()  # this flow run's: the newest with that key
    first_restart = re.search(r"\|\s*1\s*\|\s*(\w+)\s*\|", newest["data"])
    assert first_restart, newest["data"]
    assert first_restart.group(1) == str(world_size), first_restart.group(0)


def test_a_relaunch_after_a_failed_rendezvous_starts_within_seconds(restored):
    """Both ranks advertise loopback once, as stock gloo does where the host name maps to
    127.0.0.1: the rank that connects fails at once, the one that listens waits for a
    connection that never comes and holds its worker until the 60 s timeout. The relaunch
    must start within seconds (it would wait those 60 s otherwise)."""
    with restored.client() as client:
        client.run(advertise_loopback_once)
        launched = time.time()
        results, restarts = launch_with_restarts(
            client, started_at, world_size=2, timeout_s=60, max_restarts=1
        )
    assert len(restarts) == 1 and "127.0.0.1" in restarts[0].cause, restarts
    assert min(results) - launched < 30, f"relaunch started {min(results) - launched:.0f}s in"


def test_a_relaunch_after_a_stuck_rank_starts_within_seconds(restored, tmp_path):
    with restored.client() as client:
        results, restarts = launch_with_restarts(
            client, stuck_once, str(tmp_path), world_size=2, timeout_s=60, max_restarts=1
        )
    failed_at = float((tmp_path / "rank0").read_text())
    assert len(restarts) == 1
    # Seconds, not the launch's 60 s timeout: 14 s was seen with 6 runnable processes per core.
    assert max(results) - failed_at < 25, f"relaunch ran {max(results) - failed_at:.1f}s later"


def test_the_image_flow_on_two_hosts_with_an_s3_artifact_root(restored, tmp_path, monkeypatch):
    root = f"s3://{BUCKET}/images"
    for key, value in s3_env(restored.s3_endpoint).items():
        monkeypatch.setenv(key, value)
    # What is tested is the flow across hosts on S3, not how well it learns (test_images_flow
    # trains on every digit): the first 200 of them, about 20 a class.
    source = f"{root}/data/digits-200"
    fs, base = url_to_fs(source)
    first_200 = list(digits_pngs().items())[:200]  # in the digits' own order
    fs.pipe({f"{base}/{key}": png for key, png in first_200})
    training = ImageParams(
        source=source, arch="resnet18", weights="none", image_size=32, epochs=1, batch_size=32,
        world_size=2, keep_last=1,
    )  # fmt: skip
    address = restored.scheduler_address
    state = run_in_process(
        train_images, tmp_path, address, monkeypatch, restored.flow_env(root),
        training=training, return_state=True,
    )  # fmt: skip
    assert state.is_completed(), state
    client = MlflowClient(restored.mlflow_url)
    experiment = client.get_experiment_by_name("ddpflow-images")
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.info.status == "FINISHED"
    assert run.data.params["world_size"] == "2"


def assert_stopped_in_preflight(multi: MultiHost, project: Path, output: str, code: int) -> None:
    assert code == 1, output[-3000:]
    assert "PreflightError" in output or "pre-flight" in output.lower(), output[-3000:]
    assert not (project / "artifacts").exists(), "nothing written before the check"
    client = MlflowClient(multi.mlflow_url)
    experiment = client.get_experiment_by_name("ddpflow-charlm")  # None: nothing ran yet
    runs = client.search_runs([experiment.experiment_id]) if experiment else []
    assert all(r.info.run_id not in output for r in runs), "no MLflow run for this flow"


def test_an_embedded_api_with_workers_on_other_hosts_stops_in_preflight(restored, tmp_path):
    """No PREFECT_API_URL: the flow's embedded API (what the command starts) listens on the
    head node's 127.0.0.1."""
    proc = start_command(restored, tmp_path, env={"PREFECT_API_URL": ""})
    code, output = finish(proc, timeout_s=300)
    assert_stopped_in_preflight(restored, tmp_path, output, code)
    assert "2 of 2 Dask workers cannot reach the flow's embedded Prefect API" in output
    assert "prefect server start" in output


def test_an_mlflow_url_only_the_head_node_reaches_stops_in_preflight(
    restored, tmp_path, monkeypatch, capsys
):
    """Through the command line's own code (flows.cli.run_cli), in this process."""
    with loopback_forwarder(restored.mlflow_url) as local_url:
        env = {**restored.flow_env(str(tmp_path / "artifacts")), "MLFLOW_TRACKING_URI": local_url}
        address = restored.scheduler_address
        code = cli_exit_code(train_charlm, TINY, tmp_path, address, monkeypatch, env)
    captured = capsys.readouterr()
    # The failure line, and the flow run's state as Prefect recorded it (the error's type).
    recorded = latest_flow_run(train_charlm.name).state.message
    output = f"{captured.out}{captured.err}\n{recorded}"
    assert_stopped_in_preflight(restored, tmp_path, output, code)
    assert f"2 of 2 Dask workers cannot reach MLflow tracking server {local_url}" in output


def test_a_third_host_that_joins_mid_run_grows_the_group_onto_it(restored, tmp_path):
    """Host c comes up while a ddpflow.run() training runs with 2 ranks on hosts a and b and
    max_workers=3: once c's worker has stayed the settle time, the group takes a step
    checkpoint and relaunches with 3 ranks, one on c, in the same MLflow run and spending no
    restart (max_restarts=0 would fail the run otherwise). The training
    (tests/helpers/grow_functions.py) steps slowly (HOST_C_PAUSE_S) until the group grew."""
    steps, pause = tmp_path / "steps", tmp_path / "pause"
    steps.mkdir()
    pause.touch()
    stepping, gave_up = threading.Event(), threading.Event()
    resizes: list[ddpflow.Resize] = []
    restarts: list[ddpflow.Restart] = []
    third: dict[str, str] = {}  # c's IP and when its worker registered
    errors: list[BaseException] = []

    def on_event(progress: ddpflow.Progress) -> None:
        if progress.step:
            stepping.set()

    def on_resize(resize: ddpflow.Resize) -> None:
        resizes.append(resize)
        pause.unlink(missing_ok=True)  # the rest at full speed

    def bring_up_host_c() -> None:
        try:
            assert stepping.wait(120), "the training never stepped"
            if not gave_up.is_set():
                third["ip"] = restored.add_host("c", workers=1)
                third["joined_at"] = str(time.monotonic())
        except BaseException as error:  # noqa: BLE001 - reported by the test's thread
            errors.append(error)

    driver = threading.Thread(target=bring_up_host_c, daemon=True)
    driver.start()
    try:
        with restored.client() as client, distributed.get_task_stream(client) as stream:
            ddpflow.run(
                client, recorded_fit, str(steps), str(pause), False, HOST_C_PAUSE_S,
                min_workers=2, max_workers=3, settle_s=5.0, max_restarts=0,
                checkpoint_dir=str(tmp_path / "checkpoints"),
                tracking_uri=restored.mlflow_url, experiment="grow-onto-a-third-host",
                on_event=on_event, on_resize=on_resize, on_restart=restarts.append,
            )  # fmt: skip
            finished = time.monotonic()
            with restored.client() as c_client:
                a_b_c = {restored.worker_on(c_client, h) for h in ("a", "b", "c")}
    finally:
        gave_up.set()
        stepping.set()
        driver.join(timeout=150)
        if "c" in restored.workers_per_host:
            restored.remove_host("c")
    assert not errors, errors
    assert "ip" in third, "host c never came up"
    assert restarts == [], "the grow spent no restart"
    assert len(resizes) == 1, f"one resize expected, got {resizes}"
    (resize,) = resizes
    assert (resize.old_size, resize.new_size, resize.reason) == (2, 3, "joined")
    (joiner,) = resize.workers
    assert joiner.startswith(f"tcp://{third['ip']}:"), f"{joiner} is not c's worker"
    assert finished > float(third["joined_at"]), "c joined before the training ended"
    # The grown group's ranks (the tasks that finished: the first group's stopped with an
    # error) ran one on each host's worker, c's among them.
    ranks = {t["key"]: t["worker"] for t in stream.data if t["status"] == "OK"}
    ranks = {k: w for k, w in ranks.items() if k.startswith(RANK_KEY_PREFIX)}
    assert sorted(ranks.values()) == sorted(a_b_c) and joiner in a_b_c, ranks
    assert len({k.rsplit("-", 1)[1] for k in ranks}) == 1, "one launch's ranks"
    client = MlflowClient(restored.mlflow_url)
    experiment = client.get_experiment_by_name("grow-onto-a-third-host")
    (run,) = client.search_runs([experiment.experiment_id])  # one run over both groups
    assert run.info.status == "FINISHED"
    assert "ddpflow.restarts" not in run.data.tags
    sizes = sorted(client.get_metric_history(run.info.run_id, "world_size"), key=lambda m: m.step)
    assert [m.value for m in sizes] == [2.0, 3.0]
    logged = sorted(m.step for m in client.get_metric_history(run.info.run_id, "train_loss"))
    assert logged == list(range(1, logged[-1] + 1)), "each training step logged once"
    epochs = samples_by_epoch(str(steps))
    assert len(epochs) == GROW_EPOCHS
    for number, seen in enumerate(epochs, start=1):
        assert sorted(seen) == list(range(SAMPLES)), f"epoch {number}: each sample exactly once"
