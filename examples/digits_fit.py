"""The digits classifier of examples/digits.py, trained by ddpflow.fit instead of a loop.

fit() is the loop the built-in workloads train with. Over a hand-written loop it adds
checkpoints inside an epoch (every 10 steps here) that a restart resumes from exactly,
torch's RNG reseeded per step, step and epoch metrics in MLflow, and progress lines.
Run `python -m examples.digits_fit`.
"""

from __future__ import annotations

import tempfile

import distributed
from torch import nn

import ddpflow
from examples.digits import build, digits, held_out_accuracy


def train(ctx: ddpflow.TrainContext, epochs: int, lr: float = 0.05) -> float:
    x, y, x_test, y_test = digits()
    net, optimizer, scheduler = build(ctx, lr)  # as examples/digits.py builds them
    ddpflow.fit(
        ctx,
        model=ctx.wrap(net),
        optimizer=optimizer,
        train=ddpflow.TensorPairs(x, y),
        val=ddpflow.TensorPairs(x_test, y_test),
        epochs=epochs,
        batch_size=32,
        state={"scheduler": scheduler},  # checkpointed and resumed with the model
        hooks=ddpflow.FitHooks(
            loss=nn.functional.cross_entropy, on_epoch_end=lambda stats: scheduler.step()
        ),
        log_every_steps=5,
        checkpoint_every_steps=10,
    )
    return held_out_accuracy(ctx, net, step=epochs)


def main() -> None:
    with (
        distributed.LocalCluster(n_workers=2, threads_per_worker=1) as cluster,
        distributed.Client(cluster) as client,
        tempfile.TemporaryDirectory() as checkpoints,
    ):
        accuracy = ddpflow.run(
            client, train, 6, world_size=2, checkpoint_dir=checkpoints, on_progress=print
        )
    print(f"held-out accuracy: {accuracy:.3f}")


if __name__ == "__main__":
    main()
