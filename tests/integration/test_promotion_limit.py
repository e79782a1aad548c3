"""Promotions serialised by a Prefect global concurrency limit with a lease, on a real server.

The server is Prefect's own application on a copy of the migrated database, outside the
ephemeral mode the tests' other servers run in: that mode starts none of Prefect's
background services, and without the repossessor an expired lease is never revoked (a dead
holder would block for good, as it does on a flow's own temporary API). Its repossessor looks
every second instead of every 15 s, so the frozen-holder test waits one lease (60 s, the
shortest Prefect's API grants) and little more.
"""

from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient
from prefect.client.orchestration import get_client

from ddpflow.integrations.prefect.promotion_limit import LEASE_S, limit_name, promotion_lock
from ddpflow.workloads.charlm.champion import CHAMPION_ALIAS, promote
from tests.helpers.champion_helpers import add_version, constant_model, peaked_bias, write_holdout
from tests.helpers.paths import CHECKOUT
from tests.helpers.prefect_harness import api_of_this_process, prefect_server
from tests.helpers.projects import migrated_prefect_db, project_env

pytestmark = pytest.mark.integration
REPOSSESSOR_LOOP_S = 1.0
IDLE_SERVICES = (
    "SCHEDULER", "LATE_RUNS", "FOREMAN", "CANCELLATION_CLEANUP", "PAUSE_EXPIRATIONS",
    "TASK_RUN_RECORDER", "TRIGGERS", "EVENT_PERSISTER", "EVENT_LOGGER",
)  # fmt: skip
LEASING_SERVER = {
    "PREFECT__SERVER_EPHEMERAL": None,
    "PREFECT_SERVER_SERVICES_REPOSSESSOR_LOOP_SECONDS": str(REPOSSESSOR_LOOP_S),
    **{f"PREFECT_SERVER_SERVICES_{name}_ENABLED": "false" for name in IDLE_SERVICES},
}
CONTENDER = [sys.executable, "-m", "tests.helpers.promotion_contender"]
START_S = 120.0  # three processes importing Prefect at once on two busy cores


@pytest.fixture(scope="module")
def leasing_server() -> Iterator[str]:
    with prefect_server(migrated_prefect_db(), changes=LEASING_SERVER) as url:
        yield url


def read_events(folder: Path) -> list[dict]:
    return [json.loads(line) for path in folder.glob("*.jsonl") for line in path.open()]


def wait_for(folder: Path, wanted: Callable[[dict], bool], deadline_s: float) -> list[dict]:
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        if found := [e for e in read_events(folder) if wanted(e)]:
            return found
        time.sleep(0.05)
    raise AssertionError(f"nothing wanted within {deadline_s:g}s: {read_events(folder)}")


def test_three_promoters_never_overlap_and_a_frozen_holder_is_passed_after_its_lease(
    leasing_server, tmp_path
):
    """One promoter takes the limit and is frozen (SIGSTOP) while it decides; the two others
    wait for its lease to run out, then take turns; the frozen one, woken as soon as another
    has taken the limit, finds its lease lost and does not write, then takes turns too.
    A round's hold runs from taking the limit to the end of its write: no two overlap."""
    model = "contended-model"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env["PREFECT_API_URL"] = leasing_server
    go_first, go_rest = tmp_path / "go-first", tmp_path / "go-rest"
    plans = [(2, go_first, 2.0), (4, go_rest, 0.2), (4, go_rest, 0.2)]  # rounds, start, work
    processes = [
        subprocess.Popen(
            [*CONTENDER, model, str(rounds), str(tmp_path / f"{i}.jsonl"), str(go), str(work)],
            cwd=CHECKOUT,
            env=env,
        )
        for i, (rounds, go, work) in enumerate(plans)
    ]
    frozen = processes[0]
    try:
        deadline = time.monotonic() + START_S
        while len(read_events(tmp_path)) < len(processes) and time.monotonic() < deadline:
            time.sleep(0.1)
        go_first.touch()
        (taken,) = wait_for(tmp_path, lambda e: e["event"] == "acquired", 30)
        frozen.send_signal(signal.SIGSTOP)
        go_rest.touch()
        waited_s = LEASE_S + REPOSSESSOR_LOOP_S + 10
        others = wait_for(
            tmp_path, lambda e: e["event"] == "acquired" and e["pid"] != frozen.pid, waited_s
        )
        next_holder = min(e["t"] for e in others)
        frozen.send_signal(signal.SIGCONT)  # as soon as another has taken the limit
        for process in processes:
            assert process.wait(timeout=120) == 0
    finally:
        for process in processes:
            if process.poll() is None:
                process.send_signal(signal.SIGCONT)
                process.kill()

    events = read_events(tmp_path)
    by_round = {
        key: {e["event"]: e["t"] for e in group}
        for key, group in itertools.groupby(
            sorted(events, key=lambda e: (e["pid"], e["round"])), lambda e: (e["pid"], e["round"])
        )
        if key[1] >= 0
    }
    holds = sorted((r["acquired"], r["written"]) for r in by_round.values() if "written" in r)
    overlaps = [(a, b) for a, b in itertools.pairwise(holds) if b[0] < a[1]]
    assert overlaps == [], overlaps
    assert by_round[(frozen.pid, 0)].keys() == {"acquired", "lost"}, "it wrote after its lease"
    assert len(holds) == sum(rounds for rounds, _, _ in plans) - 1, by_round
    # The frozen holder kept the limit while its lease lasted, and not much longer.
    waited = next_holder - taken["t"]
    print(f"the next holder waited {waited:.1f}s for the frozen one's lease ({LEASE_S:g}s)")
    assert LEASE_S - 2 <= waited <= LEASE_S + REPOSSESSOR_LOOP_S + 8, events


def test_a_promotion_takes_its_models_limit_and_gives_it_back(leasing_server, tmp_path):
    """The flows' promotion (`promote` with Prefect's lock) on a server: the model's limit is
    created with one slot, held while the alias moves, and free again afterwards."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(uri)
    name = "limited-model"
    version, run_id = add_version(client, name, constant_model(peaked_bias()), tmp_path)
    with api_of_this_process(leasing_server):
        decision = promote(
            uri, name, run_id, version, write_holdout(tmp_path), margin=0.0, lock=promotion_lock
        )
        with get_client(sync_client=True) as prefect:
            limit = prefect.read_global_concurrency_limit_by_name(limit_name(name))

    assert decision.promoted
    assert str(client.get_model_version_by_alias(name, CHAMPION_ALIAS).version) == version
    assert (limit.limit, limit.active, limit.active_slots) == (1, True, 0)


EMBEDDED_FLOW = """
import subprocess, sys
from ddpflow.integrations.prefect import early_api
early_api.start_early()  # what a flow's command line without PREFECT_API_URL does first
worker = (
    "from prefect.settings import PREFECT_API_URL;"
    "from ddpflow.integrations.prefect.promotion_limit import shared_api_url;"
    "print('api', bool(PREFECT_API_URL.value()), 'shared', shared_api_url())"
)
print(subprocess.run([sys.executable, "-c", worker], capture_output=True, text=True).stdout)
"""


def test_a_flows_embedded_api_is_no_shared_server_in_its_worker_processes(tmp_path):
    """A process started by the flow (as its Dask workers are) has the embedded API as
    PREFECT_API_URL, and still does not take it for a server other promoters share."""
    done = subprocess.run(
        [sys.executable, "-c", EMBEDDED_FLOW], cwd=tmp_path, env=project_env(tmp_path),
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert "api True shared None" in done.stdout, done.stdout + done.stderr[-3000:]
