"""How the real pieces start: the local production-like stack (pure Python processes).

`infra.services` starts and stops single services (moto S3, MLflow, Prefect server
and worker, Dask scheduler and workers); `infra.stack` composes them
(`python -m infra.stack up|down|status`) with credentials from `infra.auth`;
`python -m infra.certs DIR` makes Dask TLS certificates (and, with --host, HTTPS ones).
For the compose stack (infra/docker/): `python -m infra.compose_secrets DIR` writes its env
files, `python -m infra.compose_check` refuses their placeholders before it starts.
"""
