"""DDP on Dask: rank planning, the process-group context and the one launcher."""

from ddpflow.distributed.context import RankContext, RankSpec
from ddpflow.distributed.launcher import LaunchError, cluster_workers, launch
from ddpflow.distributed.planning import PlanError, RankAssignment, plan_ranks

__all__ = [
    "LaunchError",
    "PlanError",
    "RankAssignment",
    "RankContext",
    "RankSpec",
    "cluster_workers",
    "launch",
    "plan_ranks",
]
