"""A user's flow whose training loses a worker mid-run, for the run_in_flow restart test:
`python -m tests.helpers.api_flows`. Rank 1 reports its pid after checkpoint 2 and the
flow's own on_progress SIGKILLs it (see api_train_functions)."""

from __future__ import annotations

import os

from prefect import flow

import ddpflow
from tests.helpers.api_train_functions import KillReportedPid, digits_killed_after_checkpoint


@flow(name="digits-killed", task_runner=ddpflow.dask_task_runner())
def digits_killed(epochs: int = 6) -> float:
    kill_reported_pid = KillReportedPid()
    accuracy = ddpflow.run_in_flow(
        digits_killed_after_checkpoint,
        epochs,
        world_size=2,
        checkpoint_dir=os.path.abspath("checkpoints"),
        on_progress=kill_reported_pid,
    )
    print(f"killed {len(kill_reported_pid.killed)} worker(s); held-out accuracy: {accuracy:.3f}")
    return accuracy


if __name__ == "__main__":
    digits_killed()
