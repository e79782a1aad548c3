"""MLflow: the run, rank 0's loggers, the spool, system metrics, lineage, the store."""
