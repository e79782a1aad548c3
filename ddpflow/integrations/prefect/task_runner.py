"""The DaskTaskRunner every flow uses, built from the environment (ddpflow.config).

DDPFLOW_CLUSTER picks the cluster (local, address, cuda, jobqueue, kubernetes; see
ddpflow.cluster.build) and DDPFLOW_CLUSTER_OPTIONS (JSON) is passed through to its class.
"""

from __future__ import annotations

import json
import logging
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from typing import Any

import dask
import distributed
from distributed.deploy import Cluster
from prefect.logging import get_logger
from prefect.settings import PREFECT_API_URL, temporary_settings
from prefect_dask import DaskTaskRunner

from ddpflow.cluster.build import build_cluster, local_cluster, task_placement
from ddpflow.config import CLUSTER_OPTIONS_ENV, ConfigError, Settings
from ddpflow.distributed import cluster_workers
from ddpflow.integrations.prefect import early_api, early_cluster
from ddpflow.integrations.prefect.flow_workers import prepare_flow_workers

DEFAULT_WAIT_FOR_WORKERS_S = 600.0
DASHBOARD_LINE = "The Dask dashboard is available at"  # prefect-dask's words
CREATING_LINE = "Creating a new Dask cluster with"  # prefect-dask's words
log = logging.getLogger(__name__)


class PlacingDaskTaskRunner(DaskTaskRunner):
    """prefect-dask's runner, plus placement: when some workers declare the CPU resource
    (CPU workers beside GPU workers), tasks (download, format, evaluate, ...) ask for CPU=1,
    so they run only there and never take a GPU worker's thread from a rank.

    The placement is a `dask.annotate` around each submit, which Dask's Client.submit
    merges into the task's annotations, so it reaches the scheduler. DDP ranks do not pass
    through here: the launcher pins them itself.

    Each submit also carries the flow's API URL to the worker (see `_flow_api_for_workers`).
    """

    def submit(
        self,
        task: Any,
        parameters: dict[str, Any],
        wait_for: Any = None,
        dependencies: Any = None,
    ) -> Any:
        if not self.entered:  # prefect's own error for a runner used before it starts
            return super().submit(task, parameters, wait_for, dependencies)
        placement = task_placement(cluster_workers(self.client))
        with _flow_api_for_workers(), dask.annotate(**placement):
            return super().submit(task, parameters, wait_for, dependencies)

    entered = False  # set between __enter__ and __exit__ (the client exists then)

    @property
    def client(self) -> Any:
        """prefect-dask's client, announcing the dashboard only where one answers: Dask's
        link names the scheduler's HTTP port (8787 by default) even when the scheduler
        serves no dashboard there (`dask scheduler --no-dashboard`, no bokeh)."""
        if self._client:
            return self._client
        # prefect-dask also announces "Creating a new Dask cluster with `<our factory>`"
        # here, before the factory runs; the factory says what it did instead (it may adopt
        # the cluster started beside the embedded API, which that line would contradict).
        quiet = _Without(DASHBOARD_LINE, f"{CREATING_LINE} `{__name__}.")
        self.logger.addFilter(quiet)
        try:
            # mypy types a property read off its class as the getter function.
            client = DaskTaskRunner.client.fget(self)  # type: ignore[attr-defined]
        finally:
            self.logger.removeFilter(quiet)
        link = client.dashboard_link
        if link and _dashboard_served(link):
            self.logger.info(f"{DASHBOARD_LINE} {link}")
        return client

    def __enter__(self) -> PlacingDaskTaskRunner:
        if self.address is None and self.cluster_class is None:
            # Built with no settings (a flow decorator, at import): the cluster settings are
            # read now, when the flow run starts, so importing a flow reads no environment.
            configure(self, Settings.from_env())
        runner = super().__enter__()
        self.entered = True
        return runner

    def __exit__(self, *args: Any) -> None:
        """Close the client and the cluster; a close that times out is logged, not raised.

        On a loaded machine a LocalCluster's workers can take longer to exit than its close
        waits (the nanny kills them after its own grace). By then the flow's result is
        decided: a slow shutdown must not turn a finished training into a failed run.
        prefect-dask's exit runs every other close before it reports the timeout, but then
        skips the base runner's exit, which marks the runner stopped: that is done here.
        """
        self.entered = False
        try:
            super().__exit__(*args)
        except TimeoutError as error:
            log.warning("the Dask cluster did not close within its timeout: %s", error)
            super(DaskTaskRunner, self).__exit__(*args)  # prefect's TaskRunner: stopped


@contextmanager
def _flow_api_for_workers() -> Iterator[None]:
    """Make the flow's API URL part of the settings that travel with each submitted task.

    prefect-dask serializes the current settings context with every task, and the worker
    runs the task inside it. On Prefect's temporary server (a flow called from Python; a
    flow's command line sets its embedded API as PREFECT_API_URL) that context has no
    URL, so a worker without PREFECT_API_URL of its own starts a temporary server: the
    task runs are recorded there, not in the flow's API, and the server outlives a worker
    that is stopped. Setting the URL only in the context sent with the task changes nothing
    on the long-lived worker process, and a URL the flow already has travels as it is.
    """
    url = None if PREFECT_API_URL.value() else prefect_api_url()
    with temporary_settings(updates={PREFECT_API_URL: url}) if url else nullcontext():
        yield


def prefect_api_url() -> str | None:
    """The API the flow talks to, including Prefect's temporary one when none is set.

    Handing it to the workers matters: a worker process without PREFECT_API_URL starts its
    own temporary API server (5-6 s each) the first time it runs a task.
    """
    url = PREFECT_API_URL.value()
    if url:
        return url
    from prefect.server.api.server import SubprocessASGIServer

    server = SubprocessASGIServer()
    return server.api_url if server.running else None


def _local_cluster_for_flow(
    num_workers: int, tls: bool = True, **options: Any
) -> distributed.LocalCluster:
    """The flow's LocalCluster: the early one if it matches, else a new one. Either way the
    runner's client connects to the cluster object, so it takes the cluster's TLS
    credentials (`cluster.security`) from it: they never pass through an address."""
    url = prefect_api_url()
    early = early_cluster.adopt(num_workers, url, options, tls)  # started with the embedded API
    if early is not None:
        get_logger("task_runner").info(early_cluster.ADOPTED)
        return early
    env = {"PREFECT_API_URL": url} if url else None
    prepare_flow_workers()
    cluster = local_cluster(num_workers, env=env, tls=tls, **options)
    get_logger("task_runner").info(f"started a Dask LocalCluster of {num_workers} workers")
    return cluster


def configured_api_url() -> str | None:
    """PREFECT_API_URL when it is a server the user set, not the flow's embedded API (which
    a flow's command line sets as PREFECT_API_URL too: early_api)."""
    url = PREFECT_API_URL.value()
    return None if url == early_api.embedded_url() else url


def _worker_env(kind: str) -> dict[str, str]:
    # Workers on this host (cuda) can reach the embedded API; workers elsewhere (jobqueue,
    # kubernetes) only a configured server, so only that one is handed to them.
    url = prefect_api_url() if kind == "cuda" else configured_api_url()
    return {"PREFECT_API_URL": url} if url else {}


def _cluster_for_flow(kind: str, options: dict[str, Any], tls: bool = True) -> Cluster:
    """Build the cluster, then wait (bounded) until the workers it asked for have joined:
    queued batch jobs and pending pods take a while, and pre-flight counts workers. A batch
    queue cluster then stays at that size: a job that ends is replaced."""
    options = dict(options)
    wait_s = float(options.pop("wait_for_workers_s", DEFAULT_WAIT_FOR_WORKERS_S))
    expected = options.get("n_workers")
    cluster = build_cluster(kind, options, env=_worker_env(kind), tls=tls)
    get_logger("task_runner").info(f"started a Dask cluster of kind {kind!r}")
    if expected:
        try:
            cluster.wait_for_workers(int(expected), timeout=wait_s)
        except TimeoutError as error:
            cluster.close()
            raise ConfigError(
                f"the {kind} cluster did not get {expected} workers within {wait_s:g}s "
                f"({error}); check the queue / pods, or raise wait_for_workers_s in "
                f"{CLUSTER_OPTIONS_ENV}"
            ) from None
        if kind == "jobqueue":
            _replace_lost_jobs(cluster, int(expected))
    return cluster


def _replace_lost_jobs(cluster: Cluster, n_workers: int) -> None:
    """Keep `n_workers` jobs queued or running for the whole flow run.

    dask-jobqueue never resubmits a job that ended under it (scancel, walltime, a node
    failure): the cluster just stays smaller. Adaptive at a fixed size does: once the lost
    worker's job is given up (distributed.deploy.lost-worker-timeout, 15 s by default) the
    cluster's spec has a worker without a job, and Adaptive's next check submits a new job
    for it. The restart logic waits for that worker before it relaunches the ranks.
    """
    cluster.adapt(minimum=n_workers, maximum=n_workers)


def dask_task_runner(settings: Settings | None = None) -> DaskTaskRunner:
    """The task runner for DDPFLOW_CLUSTER: an existing scheduler (`address`), or a cluster
    of the chosen kind started per flow run. Without `settings`, they are read from the
    environment when a flow run enters the runner.

    `@flow(task_runner=dask_task_runner())` needs `# type: ignore[arg-type]`: prefect-dask
    subclasses a bare TaskRunner, which types it TaskRunner[PrefectConcurrentFuture] (the
    type parameter's default), and flow() asks for TaskRunner[PrefectFuture[Any]]."""
    runner = PlacingDaskTaskRunner()
    if settings is not None:
        configure(runner, settings)
    return runner


def configure(runner: DaskTaskRunner, settings: Settings) -> None:
    """Point `runner` at the cluster `settings` name (before it starts)."""
    options = dict(settings.cluster_options)
    if settings.cluster_kind == "address":
        runner.address = settings.dask_address
        # A dead scheduler should fail pre-flight in seconds, not after the 30 s default.
        runner.client_kwargs["timeout"] = "10s"
    elif settings.cluster_kind == "local":
        num_workers = options.pop("n_workers", settings.num_dask_workers)
        # prefect-dask types cluster_class as taking no arguments; it passes cluster_kwargs.
        runner.cluster_class = _local_cluster_for_flow  # type: ignore[assignment]
        tls = settings.local_cluster_tls
        runner.cluster_kwargs = {"num_workers": num_workers, "tls": tls, **options}
    else:
        runner.cluster_class = _cluster_for_flow  # type: ignore[assignment]  # as above
        runner.cluster_kwargs = {"kind": settings.cluster_kind, "options": options}
        # cuda starts its workers on this machine; jobqueue and kubernetes elsewhere.
        local = settings.cluster_kind == "cuda"
        tls = settings.local_cluster_tls if local else settings.remote_cluster_tls
        runner.cluster_kwargs["tls"] = tls


class _Without(logging.Filter):
    """Drops the records whose message starts with one of `prefixes`."""

    def __init__(self, *prefixes: str):
        super().__init__()
        self.prefixes = prefixes

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(self.prefixes)


def _dashboard_served(link: str, timeout_s: float = 5.0) -> bool:
    """Whether the scheduler behind `link` serves Dask's dashboard: its
    `individual-plots.json` (what Dask's JupyterLab extension reads) lists the dashboard's
    plots, and is an empty object where the scheduler's HTTP server runs without one. Not the
    dashboard page itself: each GET of it renders a bokeh document, 0.44 s on an idle 2-core
    machine and past a 2 s timeout under a test suite's load, which dropped the line."""
    base = link.split("?", 1)[0].rstrip("/")
    base = base.removesuffix("/status")  # Dask's default link ends with the status page
    url = f"{base}/individual-plots.json"
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as reply:  # noqa: S310
            return reply.status == 200 and bool(json.loads(reply.read()))
    except (OSError, ValueError):
        return False
