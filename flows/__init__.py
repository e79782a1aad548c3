"""Prefect flows: one module per workload or job."""

# Prefect sets up its console logging (formats, levels) when its flow machinery is first
# imported, unless the root logger already has handlers by then. mlflow.pytorch, which the
# core imports, calls logging.basicConfig at import; so Prefect must come first.
from prefect import flow as _prefect_flow  # noqa: E402, F401
