"""Register a finished training's checkpoint after its own registration failed.

Run it: `python -m flows.register_checkpoint --run-id <MLflow run id>` (the command a failed
registration prints). It reads from the run which workload trained it, its latest
checkpoint and the registered model's name, registers a new version of that model from the
checkpoint, and removes the run's `ddpflow.registration_failed` tag.
"""

from __future__ import annotations

if __name__ == "__main__":
    # A command line: the embedded API starts while the imports below load.
    from ddpflow.integrations.prefect.early_api import start_services

    start_services()

from mlflow.tracking import MlflowClient
from prefect import flow

from ddpflow.config import Settings
from ddpflow.storage.redact import redact_url
from ddpflow.tracking.inspection import WORKLOAD_TAG
from ddpflow.tracking.loggers import RunRef
from ddpflow.workloads.registration import WORKLOADS
from flows.cli import run_cli
from tasks.registration import REGISTRATION_FAILED_TAG, register


@flow(name="register-checkpoint", log_prints=True)
def register_checkpoint(
    run_id: str, model_name: str | None = None, checkpoint: str | None = None
) -> str:
    """Register the run's latest checkpoint (or `checkpoint`) as a new version of its model
    (or `model_name`); the version."""
    # Here, not at the top: the checkpoint module imports torch, and importing a flow must not.
    from ddpflow.checkpoint.store import LATEST_CHECKPOINT_TAG

    tracking_uri = Settings.from_env().tracking_uri
    client = MlflowClient(tracking_uri)
    found = client.get_run(run_id)
    trained = found.data.tags.get(WORKLOAD_TAG, "")
    workload = next((w for w in WORKLOADS if trained.startswith(w)), None)
    if workload is None:
        raise ValueError(
            f"run {run_id} has {WORKLOAD_TAG}={trained!r}, not a training of "
            f"{', '.join(WORKLOADS)}: pass the run id a train, sweep or retrain flow printed"
        )
    checkpoint = checkpoint or found.data.tags.get(LATEST_CHECKPOINT_TAG)
    model_name = model_name or found.data.params.get("model_name")
    if not checkpoint or not model_name:
        raise ValueError(
            f"run {run_id} records no {'checkpoint' if not checkpoint else 'model_name'}: "
            "pass --checkpoint URI and --model-name NAME"
        )
    version = register(workload, RunRef(tracking_uri, run_id), checkpoint, model_name)
    if REGISTRATION_FAILED_TAG in found.data.tags:
        client.delete_tag(run_id, REGISTRATION_FAILED_TAG)
    print(f"registered {model_name} version {version} from {redact_url(checkpoint)} (run {run_id})")
    return version


if __name__ == "__main__":
    run_cli(register_checkpoint)
