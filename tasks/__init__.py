"""Thin Prefect task adapters around ddpflow: parse inputs, call the core, return small results."""
