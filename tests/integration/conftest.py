"""Real processes: a Dask LocalCluster with worker processes, flows run as `python -m`."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import dask
import distributed
import pytest
import torch

from ddpflow.cluster.build import local_cluster
from ddpflow.cluster.forkserver import preload_also
from ddpflow.integrations.prefect.flow_workers import prepare_flow_workers
from infra import stack
from infra.state import StackState
from tests.helpers.charlm_runs import TINY, final_weights
from tests.helpers.in_process import dotted_config
from tests.helpers.prefect_harness import (
    SHARED_PREFECT_API,
    adopt_prefect_server,
    api_of_this_process,
    prefect_server,
)
from tests.helpers.projects import (
    migrated_prefect_db,
    run_flow,
)
from tests.helpers.s3_servers import seaweedfs_server
from tests.helpers.session_folder import session_folder
from tests.helpers.slurm_cluster import Slurm, slurm_cluster


@pytest.fixture(scope="session", autouse=True)
def flow_process() -> None:
    """This process runs flows in its own process (run_in_process), as a flow's command
    does: so its clusters' workers are prepared as a flow prepares its own (Prefect in their
    forkserver, its settings read anew in each worker: flow_workers), before its first
    cluster starts the process's one forkserver. That forkserver also imports the library
    modules the flows' workers import on their first task and first registration
    (worker_warmup)."""
    prepare_flow_workers()
    preload_also(["tests.helpers.worker_warmup"])


@pytest.fixture(scope="module")
def dask_client() -> Iterator[distributed.Client]:
    """Two worker processes x one thread, on 127.0.0.1, stopped at the end of the module."""
    with local_cluster(2) as cluster, distributed.Client(cluster) as client:
        client.wait_for_workers(2, timeout=60)
        yield client


@pytest.fixture(scope="session")
def shared_prefect_server(request: pytest.FixtureRequest) -> Iterator[str]:
    """One Prefect API server (its URL) which the modules use in turn: the xdist
    controller's, shared by every test process of the run (tests/conftest.py), else one for
    this process. A start costs about 5 CPU-seconds and 5 s on an idle machine, and an idle
    server 1.5 CPU-seconds a minute. What the tests read back from it is selected by flow
    run (id, the latest of a flow name, an artifact key newest first), never "every
    record", so the runs of other modules and processes do not get in the way."""
    shared = getattr(request.config, "workerinput", {}).get(SHARED_PREFECT_API)
    if shared is not None:
        yield adopt_prefect_server(shared["url"], Path(shared["home"]))
        return
    with prefect_server(migrated_prefect_db()) as url:
        yield url


@pytest.fixture(scope="module")
def prefect_api_url(shared_prefect_server: str) -> Iterator[str]:
    """A Prefect API for a module whose flows run in this process on clusters of their own
    (flow_services has one with a cluster): its URL, this process's API meanwhile."""
    with api_of_this_process(shared_prefect_server) as url:
        yield url


@pytest.fixture(scope="module")
def flow_services_env() -> dict[str, str]:
    """Environment of flow_services' worker processes and of this process while they run
    (a module overrides it, e.g. with an S3 endpoint and its keys)."""
    return {}


@pytest.fixture(scope="module")
def flow_services(flow_services_env: dict[str, str], shared_prefect_server: str) -> Iterator[str]:
    """What `python -m flows.<name>` starts for each run, started once for a module whose
    flows run in the test's own process (run_in_process): a Prefect API and a Dask cluster
    of two worker processes (plain tcp on 127.0.0.1). Yields the scheduler's address.

    The workers run with flow_services_env, as workers started in that environment would:
    its DASK_* variables are Dask configuration too, which a nanny hands its worker (e.g. a
    worker preload)."""
    with (
        pytest.MonkeyPatch.context() as patch,
        dask.config.set(dotted_config(dask.config.collect_env(flow_services_env))),
        api_of_this_process(shared_prefect_server),
        local_cluster(2, env=flow_services_env, tls=False) as cluster,
    ):
        for name, value in flow_services_env.items():
            patch.setenv(name, value)
        yield cluster.scheduler_address


@pytest.fixture(scope="module")
def s3_endpoint(request: pytest.FixtureRequest, tmp_path_factory) -> Iterator[str]:
    """A SeaweedFS S3 server for the module (its URL), with the bucket its BUCKET constant
    names; the tests' keys (s3_env) are its administrator's. One per module rather than one
    per test process: an idle server costs more CPU over a run than the starts it would
    save (docs/testing.md "S3 in the tests")."""
    buckets = (request.module.BUCKET,) if hasattr(request.module, "BUCKET") else ()
    with seaweedfs_server(tmp_path_factory.mktemp("seaweedfs"), buckets) as endpoint:
        yield endpoint


@pytest.fixture(scope="session")
def local_stack(tmp_path_factory) -> Iterator[StackState]:
    """The local stack (`stack up --free-ports`, 2 Dask workers), one for the session: the
    deployments, the stack's own checks and its UIs in a browser share it (one group in
    tests/conftest.py), as a user's stack serves every command. Starting it is a minute or
    two of CPU on 2 cores. The test that stops it runs last in its group
    (`stops_local_stack`); the stop here is then a no-op."""
    stack_dir = tmp_path_factory.mktemp("stack")
    state = stack.start_stack(stack_dir, num_workers=2, free_ports=True)
    try:
        yield state
    finally:
        stack.stop_stack(stack_dir)


@pytest.fixture(scope="session")
def slurm(tmp_path_factory) -> Iterator[Slurm]:
    """A one-node Slurm cluster (munged, slurmctld, slurmd), installed with apt-get if
    missing; `slurm.conf` is its SLURM_CONF. Skips outside CI where it cannot run (not root,
    no apt-get); fails on CI (CI=true). Every job and daemon is stopped at the end."""
    with slurm_cluster(tmp_path_factory.mktemp("slurm")) as cluster:
        yield cluster


@pytest.fixture(scope="session")
def charlm_reference_project(tmp_path_factory) -> Path:
    """The project folder of an uninterrupted tiny 2-rank training on the laptop default (a
    LocalCluster): its checkpoints and its MLflow run are what exact resumes reproduce.
    Trained once per session, for the fault, multi-host and graceful-leave modules on
    whichever processes they run (session_folder); they only read it."""

    def train(project: Path) -> None:
        result = run_flow("train_charlm", TINY, project, timeout_s=400)
        assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]

    return session_folder(tmp_path_factory, "charlm-reference", train)


@pytest.fixture(scope="session")
def charlm_reference(charlm_reference_project: Path) -> dict[str, torch.Tensor]:
    """Final weights of the uninterrupted run, which every exact-resume and multi-host test
    must reproduce bitwise."""
    return final_weights(charlm_reference_project)
