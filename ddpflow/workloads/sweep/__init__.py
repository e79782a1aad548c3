"""Hyperparameter sweeps: many models at once (pet-name or image), each on its own workers.

config   trial configs per workload, grid expansion, per-trial validation naming the field
space    a search space (ranges, log ranges, choices) over the trial fields, validated;
         its grid points for the grid sampler
pruning  a searched trial's ranks wait for the study's verdict at each epoch's end
slots    which workers a trial holds; a queue that never runs more than the cluster holds
trial    the rank function of a trial (its workload's training + elapsed seconds)
execute  a trial's child MLflow run and outcome
plots    loss vs epoch / elapsed seconds, one panel per trial
report   ranking, table rows, what goes into the parent run
"""

from ddpflow.workloads.sweep.config import SweepConfigError, TrialConfig, TrialSpec, build_trials
from ddpflow.workloads.sweep.execute import SweepSetup, TrialOutcome, reject_trial, run_trial
from ddpflow.workloads.sweep.slots import WorkerSlots, run_queued
from ddpflow.workloads.sweep.trial import trial_rank

__all__ = [
    "SweepConfigError",
    "SweepSetup",
    "TrialConfig",
    "TrialOutcome",
    "TrialSpec",
    "WorkerSlots",
    "build_trials",
    "reject_trial",
    "run_queued",
    "run_trial",
    "trial_rank",
]
