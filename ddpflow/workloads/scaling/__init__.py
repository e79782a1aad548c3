"""Scaling runs: the same training at world sizes 1, 2, ... N, one after another.

sizes    the world sizes asked for: parsing, defaults, the fit to the cluster
report   per-size throughput, efficiency against linear, time to a target; the table
plots    samples/s and efficiency against world size
"""

from ddpflow.workloads.scaling.report import SizeResult, Target, table_rows
from ddpflow.workloads.scaling.sizes import ScalingConfigError, parse_world_sizes, plan_world_sizes

__all__ = [
    "ScalingConfigError",
    "SizeResult",
    "Target",
    "parse_world_sizes",
    "plan_world_sizes",
    "table_rows",
]
