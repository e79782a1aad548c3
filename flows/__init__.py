"""Prefect flows: one module per workload or job."""
