"""Prefect flows: one module per workload or job."""

# Prefect sets up its console logging (formats, levels) when its flow machinery is first
# imported, unless the root logger already has handlers by then. mlflow.pytorch calls
# logging.basicConfig at import: ddpflow.mlflow_pytorch undoes that for ddpflow's own import,
# and Prefect coming first keeps it so when other code imports mlflow.pytorch directly.
from prefect import flow as _prefect_flow  # noqa: E402, F401
