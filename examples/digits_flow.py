"""The digits classifier (examples/digits_fit.py, on ddpflow.fit) as a step of a Prefect flow.

The flow runs on ddpflow's DaskTaskRunner (a LocalCluster of DDPFLOW_DASK_WORKERS workers
by default; DDPFLOW_CLUSTER picks another), and ddpflow.run_in_flow() trains on its workers:
progress lines and restarts go to the flow run's log, the steps to the task's progress
artifact `ddp-train-progress`. With MLFLOW_TRACKING_URI set, the training is tracked in the
experiment "digits". Run `python -m examples.digits_flow`.
"""

from __future__ import annotations

import os

from prefect import flow
from prefect.runtime import flow_run

import ddpflow
from examples.digits_fit import train


@flow(name="digits", task_runner=ddpflow.dask_task_runner(), log_prints=True)
def digits_flow(epochs: int = 20, lr: float = 0.05, checkpoint_root: str = "checkpoints") -> float:
    """Train on 2 ranks and print the held-out accuracy; each flow run checkpoints into a
    folder of its own, so a retry of the same run resumes and a new run starts afresh."""
    tracking_uri = os.environ.get("MLFLOW_TRACKING_URI")
    accuracy = ddpflow.run_in_flow(
        train,
        epochs,
        lr,
        world_size=2,
        checkpoint_dir=os.path.abspath(os.path.join(checkpoint_root, f"digits-{flow_run.id}")),
        tracking_uri=tracking_uri,
        experiment="digits" if tracking_uri else None,
        params={"epochs": epochs, "lr": lr},
    )
    print(f"held-out accuracy: {accuracy:.3f}")
    return accuracy


if __name__ == "__main__":
    digits_flow()
