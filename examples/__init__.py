"""Workloads written only against ddpflow's public API (docs/api.md)."""
