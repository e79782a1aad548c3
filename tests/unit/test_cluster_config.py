"""Cluster kinds from settings, missing extras, placement and resource planning: no processes."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from ddpflow.cluster import build as cluster
from ddpflow.cluster.build import build_cluster, task_placement
from ddpflow.config import (
    CLUSTER_ENV,
    CLUSTER_OPTIONS_ENV,
    DASK_ADDRESS_ENV,
    RANK_RESOURCES_ENV,
    ConfigError,
    Settings,
)
from ddpflow.distributed.planning import PlanError, choose_backend, workers_with_resources
from ddpflow.integrations.prefect import task_runner as runner


def settings(tmp_path: Path, **env: str) -> Settings:
    return Settings.from_env(env=env, project_dir=tmp_path)


# --- DDPFLOW_CLUSTER and friends ---------------------------------------------------------


def test_default_is_a_local_cluster_without_resources(tmp_path: Path) -> None:
    s = settings(tmp_path)
    assert (s.cluster_kind, dict(s.cluster_options), s.rank_resources) == ("local", {}, None)


def test_an_address_implies_the_address_kind(tmp_path: Path) -> None:
    s = settings(tmp_path, **{DASK_ADDRESS_ENV: "tcp://scheduler:8786"})
    assert s.cluster_kind == "address"
    assert s.dask_address == "tcp://scheduler:8786"


@pytest.mark.parametrize("kind", ["local", "cuda", "jobqueue", "kubernetes", " JobQueue "])
def test_each_kind_is_read(tmp_path: Path, kind: str) -> None:
    assert settings(tmp_path, **{CLUSTER_ENV: kind}).cluster_kind == kind.strip().lower()


def test_options_and_rank_resources_are_json(tmp_path: Path) -> None:
    s = settings(
        tmp_path,
        **{
            CLUSTER_ENV: "jobqueue",
            CLUSTER_OPTIONS_ENV: '{"queue": "gpu", "cores": 8, "job_extra_directives": ["-x"]}',
            RANK_RESOURCES_ENV: '{"GPU": 1}',
        },
    )
    assert s.cluster_options == {"queue": "gpu", "cores": 8, "job_extra_directives": ["-x"]}
    assert s.rank_resources == {"GPU": 1.0}


@pytest.mark.parametrize(
    ("env", "fragment"),
    [
        ({CLUSTER_ENV: "slurm"}, "is not a cluster kind; use one of local, address, cuda"),
        ({CLUSTER_ENV: "address"}, "needs DDPFLOW_DASK_ADDRESS"),
        ({CLUSTER_ENV: "cuda", DASK_ADDRESS_ENV: "tcp://s:8786"}, "unset one of them"),
        ({CLUSTER_OPTIONS_ENV: "{queue: gpu}"}, "DDPFLOW_CLUSTER_OPTIONS is not valid JSON"),
        ({CLUSTER_OPTIONS_ENV: "[1, 2]"}, "DDPFLOW_CLUSTER_OPTIONS must be a JSON object"),
        ({RANK_RESOURCES_ENV: '{"GPU": 0}'}, "must be positive numbers"),
        ({RANK_RESOURCES_ENV: '{"GPU": "one"}'}, "must be positive numbers"),
    ],
)
def test_bad_cluster_settings_name_the_variable(
    tmp_path: Path, env: dict[str, str], fragment: str
) -> None:
    with pytest.raises(ConfigError, match=fragment):
        settings(tmp_path, **env)


# --- the task runner each kind gets --------------------------------------------------------


def test_local_kind_gets_a_per_run_local_cluster(tmp_path: Path) -> None:
    s = settings(tmp_path, DDPFLOW_DASK_WORKERS="3")
    task_runner = runner.dask_task_runner(s)
    assert isinstance(task_runner, runner.PlacingDaskTaskRunner)
    assert task_runner.cluster_class is runner._local_cluster_for_flow
    assert task_runner.cluster_kwargs == {"num_workers": 3, "tls": True}


def test_local_options_pass_through(tmp_path: Path) -> None:
    s = settings(tmp_path, **{CLUSTER_OPTIONS_ENV: '{"n_workers": 4, "threads_per_worker": 2}'})
    kwargs = runner.dask_task_runner(s).cluster_kwargs
    assert kwargs == {"num_workers": 4, "tls": True, "threads_per_worker": 2}


def test_a_flows_runner_reads_the_cluster_settings_when_the_run_starts(monkeypatch) -> None:
    """The flow decorators build their runner at import; the environment is read later, on
    entering it (a bad value then fails that flow run, naming the variable)."""
    monkeypatch.setenv(CLUSTER_ENV, "no-such-kind")
    task_runner = runner.dask_task_runner()  # what `@flow(task_runner=...)` does at import
    assert task_runner.address is None and task_runner.cluster_class is None
    fresh = task_runner.duplicate()  # what each flow run enters
    with pytest.raises(ConfigError, match="DDPFLOW_CLUSTER='no-such-kind'"):
        fresh.__enter__()
    monkeypatch.setenv(CLUSTER_ENV, "address")
    monkeypatch.setenv(DASK_ADDRESS_ENV, "tcp://127.0.0.1:1")
    runner.configure(fresh, Settings.from_env())
    assert fresh.address == "tcp://127.0.0.1:1"


def test_address_kind_connects(tmp_path: Path) -> None:
    task_runner = runner.dask_task_runner(settings(tmp_path, DDPFLOW_DASK_ADDRESS="tcp://s:8786"))
    assert task_runner.address == "tcp://s:8786"
    assert task_runner.client_kwargs["timeout"] == "10s"


@pytest.mark.parametrize("kind", ["cuda", "jobqueue", "kubernetes"])
def test_other_kinds_build_their_cluster_in_the_flow_run(tmp_path: Path, kind: str) -> None:
    s = settings(tmp_path, **{CLUSTER_ENV: kind, CLUSTER_OPTIONS_ENV: '{"n_workers": 2}'})
    task_runner = runner.dask_task_runner(s)
    assert task_runner.cluster_class is runner._cluster_for_flow
    # TLS by default for each: cuda's is the local switch's, the others the remote one's.
    assert task_runner.cluster_kwargs == {"kind": kind, "options": {"n_workers": 2}, "tls": True}


# --- missing extras and the cuda kind --------------------------------------------------------


@pytest.mark.parametrize(
    ("kind", "module"),
    [("cuda", "dask_cuda"), ("jobqueue", "dask_jobqueue"), ("kubernetes", "dask_kubernetes")],
)
def test_a_missing_extra_names_the_pip_command(
    monkeypatch: pytest.MonkeyPatch, kind: str, module: str
) -> None:
    # None in sys.modules makes the import fail as if the package were not installed.
    for name in [m for m in sys.modules if m == module or m.startswith(module + ".")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, module, None)
    with pytest.raises(ConfigError) as info:
        build_cluster(kind, {})
    assert f"pip install 'ddpflow[{kind}]'" in str(info.value)
    assert f"cluster kind '{kind}'" in str(info.value)


def test_cuda_kind_without_cuda_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    """dask-cuda is installed (dev extra); torch reporting no CUDA must stop the build."""
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    with pytest.raises(ConfigError, match="needs NVIDIA GPUs.*DDPFLOW_CLUSTER=local"):
        build_cluster("cuda", {})


def test_address_is_not_built(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ConfigError, match="connects to DDPFLOW_DASK_ADDRESS"):
        build_cluster("address", {})


def test_unknown_jobqueue_system_is_rejected() -> None:
    with pytest.raises(ConfigError, match="system='torque' is not one of slurm, pbs"):
        build_cluster("jobqueue", {"system": "torque"})


# --- placement of non-rank tasks and resource planning ---------------------------------------

GPU_CLUSTER = {
    "tcp://10.0.0.1:1": {"resources": {"CPU": 4}},
    "tcp://10.0.0.2:1": {"resources": {"GPU": 1}},
    "tcp://10.0.0.3:1": {"resources": {"GPU": 1}},
}


def test_tasks_ask_for_cpu_when_cpu_workers_declare_it() -> None:
    assert task_placement(GPU_CLUSTER) == {"resources": {"CPU": 1}}


@pytest.mark.parametrize(
    "workers",
    [
        {},
        {"tcp://a:1": {"resources": {}}, "tcp://b:1": {}},
        {"tcp://a:1": {"resources": {"GPU": 1}}},
    ],
)
def test_tasks_run_anywhere_without_cpu_workers(workers: dict) -> None:
    assert task_placement(workers) == {}


def test_only_workers_with_the_resources_are_candidates() -> None:
    assert sorted(workers_with_resources(GPU_CLUSTER, {"GPU": 1}, 2)) == [
        "tcp://10.0.0.2:1",
        "tcp://10.0.0.3:1",
    ]
    assert list(workers_with_resources(GPU_CLUSTER, {"CPU": 2})) == ["tcp://10.0.0.1:1"]


def test_too_few_resource_workers_names_the_requirement() -> None:
    with pytest.raises(PlanError) as info:
        workers_with_resources(GPU_CLUSTER, {"GPU": 1}, 3)
    message = str(info.value)
    assert "world_size=3 needs 3 Dask worker(s) with resources {'GPU': 1}" in message
    assert "2 of the 3 workers declare them" in message
    assert "--resources GPU=1" in message


def test_no_resource_worker_at_all() -> None:
    with pytest.raises(PlanError, match="the DDP group needs 1 Dask worker"):
        workers_with_resources({"tcp://a:1": {}}, {"GPU": 1})


def test_mixed_devices_are_rejected_by_name() -> None:
    with pytest.raises(PlanError, match="mixed rank group.*NCCL needs a GPU on every rank"):
        choose_backend({"tcp://a:1": True, "tcp://b:1": False})


def test_the_gpu_and_cpu_resource_names() -> None:
    assert (cluster.GPU_RESOURCE, cluster.CPU_RESOURCE) == ("GPU", "CPU")


def test_worker_env_is_worker_config_as_dask_reads_it() -> None:
    """What `dask worker` processes get through WORKER_ENV equals what ddpflow's own
    clusters get through WORKER_CONFIG, and the nanny's other defaults survive."""
    import copy

    import dask

    defaults = copy.deepcopy(dask.config.config)
    parsed = dask.config.update(defaults, dask.config.collect_env(dict(cluster.WORKER_ENV)))
    for key, value in cluster.WORKER_CONFIG.items():
        assert dask.config.get(key, config=parsed) == value, key
    environ = dask.config.get("distributed.nanny.pre-spawn-environ", config=parsed)
    assert environ["MALLOC_TRIM_THRESHOLD_"] is None and environ["OMP_NUM_THREADS"] == 1


@pytest.mark.parametrize("raw", ["0", "-5", "inf", "nan", "soon"])
def test_heal_timeout_must_be_a_finite_positive_number(raw: str, tmp_path) -> None:
    with pytest.raises(ConfigError, match=f"DDPFLOW_HEAL_TIMEOUT_S={raw!r}.*e.g. 120"):
        Settings.from_env({"DDPFLOW_HEAL_TIMEOUT_S": raw}, project_dir=tmp_path)


def test_heal_timeout_defaults_to_two_minutes_and_can_be_set(tmp_path) -> None:
    assert Settings.from_env({}, project_dir=tmp_path).heal_timeout_s == 120.0
    settings = Settings.from_env({"DDPFLOW_HEAL_TIMEOUT_S": "30"}, project_dir=tmp_path)
    assert settings.heal_timeout_s == 30.0
