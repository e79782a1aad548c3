"""ddpflow: DDP training on Dask, tracked in MLflow."""
