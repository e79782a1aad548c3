"""Prefect flows: one module per workload or job.

Importing this package, or any flow module, starts nothing: a flow's command line
(`python -m flows.<name>`) starts its embedded Prefect API and LocalCluster from the flow
module's own `__main__` guard, before that module's imports
(ddpflow/integrations/prefect/early_api.py).
"""
