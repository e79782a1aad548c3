"""Prefect flows: one module per workload or job."""

import os
import sys

from ddpflow_flows import early_api, early_cluster

# First, before the imports below: a flow's command line starts its embedded Prefect API
# now, so that the server's start overlaps this process's imports (ddpflow_flows/early_api.py),
# and its LocalCluster, which overlaps the server's start (ddpflow_flows/early_cluster.py).
if early_api.wanted(sys.orig_argv, os.environ):
    early_api.start_early()
    if url := early_api.api_url():
        early_cluster.start_early(url)

# Prefect sets up its console logging (formats, levels) when its flow machinery is first
# imported, unless the root logger already has handlers by then. mlflow.pytorch calls
# logging.basicConfig at import: ddpflow.mlflow_pytorch undoes that for ddpflow's own import,
# and Prefect coming first keeps it so when other code imports mlflow.pytorch directly.
from prefect import flow as _prefect_flow  # noqa: E402, F401
