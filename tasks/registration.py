"""Registering a trained model in MLflow: one task for every workload, and what a flow does
when registration fails after the training succeeded.

An export that fails in the worker's own process is tried again at once in a fresh one
(ddpflow.workloads.registration says why); the task is retried, and a registration that
still fails never costs the training: the run is tagged with the cause, the checkpoint stays
where it is, and the error says how to register it later
(`python -m flows.register_checkpoint --run-id ...`).
"""

from __future__ import annotations

import logging
import threading

from mlflow.tracking import MlflowClient
from prefect import get_run_logger, task

from ddpflow.storage.bounded import call_bounded
from ddpflow.storage.redact import redact_text, redact_url
from ddpflow.tracking.inspection import describe_version
from ddpflow.tracking.loggers import RunRef
from ddpflow.workloads.registration import (
    Workload,
    register_from_checkpoint,
    register_in_fresh_process,
)

log = logging.getLogger(__name__)
RETRIES = 2  # three tries in all: a failure that survives a fresh process each time is real
RETRY_DELAY_S = 5.0
REGISTRATION_FAILED_TAG = "ddpflow.registration_failed"
# An in-process export that failed and was done again in a fresh interpreter: what failed
# and which other threads the worker's process had then. Nothing is lost (the fresh process
# registered the model), so without this record such a failure would go unseen. The one
# cause found (Dask's profiler) is paused for the export; this records any other
# (docs/fault-tolerance.md "Registration after a finished training").
IN_PROCESS_FAILURE_TAG = "ddpflow.registration_in_process_failure"
TAG_TIMEOUT_S = 30.0


class RegistrationFailed(RuntimeError):
    """The training and its evaluation finished; registering its model did not."""


@task(name="register-model", retries=RETRIES, retry_delay_seconds=RETRY_DELAY_S)
def register(workload: Workload, run: RunRef, checkpoint_uri: str, model_name: str) -> str:
    """Log the final model to the MLflow run, register a new version and describe it."""
    try:
        version = register_from_checkpoint(workload, run, checkpoint_uri, model_name)
    except Exception as error:  # noqa: BLE001 - the fresh process raises what is still wrong
        # A fresh interpreter costs 10-20 s of imports; only an export that failed pays it.
        me = threading.current_thread()
        others = sorted(t.name for t in threading.enumerate() if t is not me)
        seen = f"{redact_text(str(error))} (the process's other threads: {', '.join(others)})"
        get_run_logger().warning(
            "registering %r in this worker's process failed: %s; trying a fresh process",
            model_name,
            seen,
        )
        _tag(run, IN_PROCESS_FAILURE_TAG, seen)
        version = register_in_fresh_process(workload, run, checkpoint_uri, model_name)
    describe_version(run, model_name, version)
    return version


def register_trained(workload: Workload, run: RunRef, checkpoint_uri: str, model_name: str) -> str:
    """The register-model task for a finished training: the version, or RegistrationFailed
    naming the cause and the command that registers the checkpoint later."""
    try:
        return register.submit(workload, run, checkpoint_uri, model_name).result()
    except Exception as error:
        cause = redact_text(str(error)) or type(error).__name__
        _tag(run, REGISTRATION_FAILED_TAG, cause)
        raise RegistrationFailed(
            f"training and evaluation finished (MLflow run {run.run_id}, checkpoint "
            f"{redact_url(checkpoint_uri)}), but registering {model_name!r} failed "
            f"{RETRIES + 1} times: {cause}. The checkpoint is kept; register it later with: "
            f"python -m flows.register_checkpoint --run-id {run.run_id}"
        ) from error


def _tag(run: RunRef, key: str, text: str) -> None:
    """Say on the run what failed; an MLflow that is down too only costs the tag."""
    try:
        call_bounded(
            lambda: MlflowClient(run.tracking_uri).set_tag(run.run_id, key, text[:5000]),
            TAG_TIMEOUT_S,
            f"tagging the run with {key}",
        )
    except Exception as error:  # noqa: BLE001 - the failure is logged or raised besides
        log.warning("could not tag run %s with %s: %s", run.run_id, key, error)
