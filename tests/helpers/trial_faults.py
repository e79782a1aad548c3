"""A Dask worker preload for the sweep tests: the trial whose lr is FAULTY_LR trains one
epoch, then crashes on every rank.

Fault injection lives in the tests, not in the product. A test starts the sweep flow with
`DASK_DISTRIBUTED__WORKER__PRELOAD` naming this module (`PRELOAD_ENV`); every worker of
the flow's LocalCluster imports it when it starts and runs `dask_setup`, which wraps the
training function the sweep's trial ranks call. Everything else is the real flow.
"""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

FAULTY_LR = 0.00123  # a learning rate no other test trial uses
PRELOAD_ENV = {"DASK_DISTRIBUTED__WORKER__PRELOAD": json.dumps([__name__])}


class InjectedFault(RuntimeError):
    """The crash of the trial with lr=FAULTY_LR, after its first epoch."""


def dask_setup(worker: Any) -> None:
    # The trial's rank imports train_rank from here when it runs (ddpflow.workloads.sweep.trial).
    import ddpflow.workloads.charlm.training as training

    train_rank = training.train_rank

    def crashes_after_one_epoch(ctx: Any, job: Any, **hooks: Any) -> Any:
        # hooks: a searched trial's on_epoch_end (ddpflow.workloads.sweep.pruning).
        if job.lr != FAULTY_LR:
            return train_rank(ctx, job, **hooks)
        train_rank(ctx, replace(job, epochs=1))  # its epoch-1 metrics stay in MLflow
        raise InjectedFault(f"injected fault after epoch 1 of {job.epochs} (lr={FAULTY_LR})")

    training.train_rank = crashes_after_one_epoch
