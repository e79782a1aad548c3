"""What the flows print at the end: where to look next."""

from __future__ import annotations

from ddpflow.storage.redact import redact_url
from ddpflow.tracking.inspection import TRAINING_VIEW


def mlflow_ui_hint(tracking_uri: str, run_id: str) -> str:
    """Where to see the run; a tracking URI's credentials are shown as ***."""
    tracking_uri = redact_url(tracking_uri)
    if tracking_uri.startswith(("http://", "https://")):
        return f"open {tracking_uri.rstrip('/')}/#/runs/{run_id}{TRAINING_VIEW}"
    return (
        f".venv/bin/mlflow ui --backend-store-uri {tracking_uri} --host 127.0.0.1 "
        f"--port 5000   then open http://127.0.0.1:5000/#/runs/{run_id}{TRAINING_VIEW}"
    )


def kept_line(files: int, num_bytes: int) -> str:
    """What a run's checkpoint folder keeps, for the summary: the same count is in MLflow."""
    return f"{files} kept, {num_bytes / 1e6:.1f} MB; MLflow holds the same epoch-end ones"
