"""The Dask cluster a flow runs on: built from DDPFLOW_CLUSTER, or an existing one."""
