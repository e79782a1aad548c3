"""MLflow: the flow creates one run; rank 0 logs into it by run_id, the other ranks only
their system metrics (ddpflow.tracking.system_metrics).

MLflow's "active run" is thread-local and Dask runs code in other threads and processes,
so every call here names the tracking URI and run id explicitly (MlflowClient).
"""

from __future__ import annotations

import logging
import os
import tempfile
import warnings
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import mlflow
import numpy as np
from mlflow.entities import Param, RunTag
from mlflow.models import infer_signature
from mlflow.tracking import MlflowClient

from ddpflow.cluster.profiler import worker_profiler_paused
from ddpflow.storage.bounded import call_bounded
from ddpflow.storage.redact import redact_text, redact_url
from ddpflow.tracking.loggers import MlflowLogger, RunRef
from ddpflow.tracking.spool import Unsent
from ddpflow.tracking.store.sqlite import prepare_sqlite_store

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)
# Opens the experiment in the MLflow UI's "Model training" view (metric charts) instead of
# the GenAI view that MLflow 3.17 picks for experiments without a kind.
EXPERIMENT_KIND_TAG = "mlflow.experimentKind"
EXPERIMENT_KIND = "custom_model_development"
MAX_PARAM_LEN = 6000
# MLflow's client retries a dead or failing server for about 5 minutes.
END_RUN_TIMEOUT_S = 15.0
PARENT_RUN_TAG = "mlflow.parentRunId"
# On a run that lacks logging calls MLflow never took (ddpflow.tracking.spool).
TRACKING_INCOMPLETE_TAG = "ddpflow.tracking_incomplete"


def ensure_experiment(client: MlflowClient, name: str, artifact_location: str | None) -> str:
    experiment = client.get_experiment_by_name(name)
    if experiment is None:
        experiment_id = client.create_experiment(name, artifact_location=artifact_location)
    else:
        experiment_id = experiment.experiment_id
    client.set_experiment_tag(experiment_id, EXPERIMENT_KIND_TAG, EXPERIMENT_KIND)
    return experiment_id


def default_artifact_location(tracking_uri: str, folder: str | Path) -> str | None:
    """Where a new experiment in a SQLite store keeps MLflow's artifacts: `folder` (a path
    or a URI), instead of MLflow's own default, `./mlruns` of whatever the working
    directory is. The flows pass their artifact root's `mlflow/`, so one setting says where
    everything a run writes goes.

    A tracking server decides its own artifact destination, so it gets None.
    """
    if not tracking_uri.startswith("sqlite:"):
        return None
    location = str(folder)
    return location if "://" in location else Path(location).resolve().as_uri()


def sqlite_folder(tracking_uri: str) -> Path:
    """The folder of a `sqlite:///` store's file (the working directory for other URIs)."""
    return Path(tracking_uri.removeprefix("sqlite:///")).resolve().parent


def start_run(
    tracking_uri: str,
    experiment_name: str,
    run_name: str,
    params: Mapping[str, Any],
    tags: Mapping[str, str],
    artifact_location: str | None = None,
    parent_run_id: str | None = None,
) -> RunRef:
    """Create the one MLflow run of a training and log its parameters and tags.

    With `parent_run_id` the run is a child (e.g. a sweep's trial): the MLflow UI nests it
    under its parent through the `mlflow.parentRunId` tag.
    """
    prepare_sqlite_store(tracking_uri)  # the first run on a fresh file creates its schema
    client = MlflowClient(tracking_uri)
    experiment_id = ensure_experiment(client, experiment_name, artifact_location)
    tags = {**tags, PARENT_RUN_TAG: parent_run_id} if parent_run_id else dict(tags)
    run = client.create_run(experiment_id, run_name=run_name, tags=tags)
    param_batch = [Param(k, str(v)[:MAX_PARAM_LEN]) for k, v in sorted(params.items())]
    client.log_batch(run.info.run_id, params=param_batch)
    return RunRef(tracking_uri, run.info.run_id, experiment_id)


def log_restart(run: RunRef, attempt: int, cause: str) -> None:
    """Count restarts on the training's one run (its metrics simply continue afterwards)."""
    client = MlflowClient(run.tracking_uri)
    client.set_tag(run.run_id, "ddpflow.restarts", str(attempt))
    # Redacted before it is cut: a cut could leave "user:pass" without the "@" that marks it.
    shown = redact_text(cause)[:MAX_PARAM_LEN]
    client.set_tag(run.run_id, f"ddpflow.restart.{attempt}.cause", shown)
    client.log_metric(run.run_id, "restarts", attempt, step=attempt)


FINAL_WORLD_SIZE_TAG = "ddpflow.final_world_size"  # the size the training ended at
WORLD_SIZES_TAG = "ddpflow.world_sizes"  # every size it ran at, in order: "2 → 3 → 2"


class SizeChange(Protocol):
    """A change of the group's size (ddpflow.distributed.supervisor.relaunch.Resize)."""

    @property  # read only: Resize is frozen
    def old_size(self) -> int: ...
    @property
    def new_size(self) -> int: ...


def world_size_history(changes: Sequence[SizeChange], final: int) -> tuple[int, ...]:
    """The group's sizes in order, from the first launch's to `final` (the ranks that
    returned): (2, 3, 2) for a group that grew and then lost a worker, (2,) for none."""
    sizes = [changes[0].old_size, *(c.new_size for c in changes)] if changes else []
    if not sizes or sizes[-1] != final:
        sizes.append(final)
    return tuple(sizes)


def world_sizes_text(sizes: Sequence[int]) -> str:
    """'3 ranks (2 → 3)' after a change of size, '2 ranks' without one."""
    history = f" ({' → '.join(map(str, sizes))})" if len(sizes) > 1 else ""
    return f"{sizes[-1]} ranks{history}"


def log_world_sizes(
    run: RunRef, sizes: Sequence[int], timeout_s: float = END_RUN_TIMEOUT_S
) -> None:
    """Tag the run with the size the training ended at and every size it ran at. The
    `world_size` param is the size it was launched with (params never change), and the
    `world_size` metric has a point per attempt.

    A training that finished is not failed for want of these tags: with MLflow slow or
    down (its client retries for minutes) this waits at most `timeout_s` and warns."""
    tags = {FINAL_WORLD_SIZE_TAG: str(sizes[-1]), WORLD_SIZES_TAG: " → ".join(map(str, sizes))}
    what = f"tagging MLflow run {run.run_id} with its world sizes"

    def tag() -> None:
        MlflowClient(run.tracking_uri).log_batch(
            run.run_id, tags=[RunTag(k, v) for k, v in tags.items()]
        )

    try:
        call_bounded(tag, timeout_s, what)
    except Exception as error:  # noqa: BLE001 - a record of the training, not the training
        log.warning("%s failed: %s", what, redact_text(str(error)))


def register_pt2_model(
    run: RunRef,
    serving: torch.nn.Module,
    example: np.ndarray,
    registered_name: str,
    quiet_warnings: Sequence[Mapping[str, Any]] = (),
) -> str:
    """Log `serving` to the run in torch.export format with a signature, register it.

    pt2 rather than pickle: loading it needs torch, not ddpflow's classes. Explicit pip
    requirements skip MLflow's slow dependency inference. `quiet_warnings` are
    `warnings.filterwarnings` arguments for export notes known to be harmless.

    In a Dask worker, the worker's profiler is paused for the export: it can make torch.export
    fail (ddpflow.cluster.profiler says how).
    """
    import torch  # lazy: the flow process imports this module and starts without torch

    from ddpflow.tracking.mlflow_pytorch import mlflow_pytorch

    with torch.no_grad():
        signature = infer_signature(example, serving(torch.from_numpy(example)).numpy())
    mlflow.set_tracking_uri(run.tracking_uri)
    with (
        mlflow.start_run(run_id=run.run_id),
        warnings.catch_warnings(),
        worker_profiler_paused(),
    ):
        for quiet in quiet_warnings:
            warnings.filterwarnings("ignore", **quiet)
        info = mlflow_pytorch.log_model(
            serving,
            name="model",
            signature=signature,
            input_example=example,
            pip_requirements=[f"torch=={torch.__version__.split('+')[0]}"],
            serialization_format="pt2",
            registered_model_name=registered_name,
        )
    return str(info.registered_model_version)


@contextmanager
def failed_on_error(run: RunRef) -> Iterator[RunRef]:
    """The run's lifecycle around the work done in it: an error (or an interrupt) marks it
    FAILED on the way out, bounded, and comes through unchanged. Ending it after success is
    the caller's, who knows what to say (FINISHED, FAILED with no trial done, incomplete)."""
    try:
        yield run
    except BaseException:
        end_run(run, failed=True)
        raise


def end_run(
    run: RunRef,
    failed: bool = False,
    timeout_s: float = END_RUN_TIMEOUT_S,
    unsent: Sequence[Unsent] = (),
) -> None:
    """Mark the run FINISHED or FAILED, waiting at most `timeout_s` for MLflow.

    With `unsent` (logging calls MLflow never took) the run first gets the tag
    `ddpflow.tracking_incomplete`, so a reader of the run sees that it lacks something.

    A run is marked FAILED on the way out of an error the caller re-raises, so that never
    raises: with MLflow down it logs a warning and the original error comes through. A run
    that finished but cannot be marked so raises (TimeoutError or MLflow's error): it stays
    RUNNING in MLflow.
    """
    status = "FAILED" if failed else "FINISHED"
    client = MlflowClient(run.tracking_uri)
    what = f"marking MLflow run {run.run_id} {status} at {redact_url(run.tracking_uri)}"

    def mark() -> None:
        if unsent:
            client.set_tag(run.run_id, TRACKING_INCOMPLETE_TAG, incomplete_note(unsent))
        client.set_terminated(run.run_id, status)

    try:
        call_bounded(mark, timeout_s, what)
    except Exception as error:
        if not failed:
            raise
        log.warning("%s failed, the run stays RUNNING: %s", what, redact_text(str(error)))


def incomplete_note(unsent: Sequence[Unsent]) -> str:
    """The tag's value: how many calls are missing and where they wait."""
    paths = [u.path for u in unsent if u.path]
    reasons = sorted({u.not_kept_because for u in unsent if not u.path})
    note = f"{len(unsent)} logging calls are not in this run"
    if reasons:
        note += f" ({len(unsent) - len(paths)} not kept: {'; '.join(reasons)})"
    if paths:
        note += f"; the others wait on disk under {os.path.commonpath(paths)}"
    return note[:MAX_PARAM_LEN]


def metric_history(run: RunRef, key: str) -> list[tuple[int, float]]:
    """(step, value) pairs of one metric, in step order."""
    history = MlflowClient(run.tracking_uri).get_metric_history(run.run_id, key)
    return sorted((m.step, m.value) for m in history)


def log_files(run: RunRef, files: Mapping[str, bytes], folder: str) -> None:
    """Log in-memory files (plots, tables) as artifacts of `run` under `folder`."""
    logger = MlflowLogger(run)
    with tempfile.TemporaryDirectory() as tmp:
        for name, data in files.items():
            path = os.path.join(tmp, name)
            Path(path).write_bytes(data)
            logger.log_artifact(path, folder)
