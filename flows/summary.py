"""What the flows print at the end: where to look next."""

from __future__ import annotations

from ddpflow.storage.redact import redact_url


def mlflow_ui_hint(tracking_uri: str, run_id: str) -> str:
    """Where to see the run; a tracking URI's credentials are shown as ***."""
    tracking_uri = redact_url(tracking_uri)
    if tracking_uri.startswith(("http://", "https://")):
        return f"open {tracking_uri.rstrip('/')}/#/runs/{run_id}"
    return (
        f".venv/bin/mlflow ui --backend-store-uri {tracking_uri} --host 127.0.0.1 "
        f"--port 5000   then open http://127.0.0.1:5000/#/runs/{run_id}"
    )
