"""How the real pieces start: the local production-like stack (pure Python processes).

`ddpflow_infra.services` starts and stops single services (moto S3, MLflow, Prefect server
and worker, Dask scheduler and workers); `ddpflow_infra.stack` composes them
(`python -m ddpflow_infra.stack up|down|status`) with credentials from `ddpflow_infra.auth`;
`python -m ddpflow_infra.certs DIR` makes Dask TLS certificates.
"""
