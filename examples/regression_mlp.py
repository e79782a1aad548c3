"""Your own model on ddpflow, as a new user writes it: an MLP with dropout regressing a
synthetic function, trained on two ranks with ddpflow.fit, then read back with
ddpflow.load_checkpoint. Only the documented API (docs/api.md) is used.

Run `python -m examples.regression_mlp` (a local Dask cluster of two workers).
"""

from __future__ import annotations

import tempfile

import distributed
import torch
from torch import nn

import ddpflow

NUM_SAMPLES, NUM_FEATURES = 2048, 8


def make_data(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """y = sin of a fixed projection of x, plus noise: the same on every rank."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(NUM_SAMPLES, NUM_FEATURES, generator=gen)
    w = torch.randn(NUM_FEATURES, 1, generator=gen)
    y = torch.sin(x @ w) + 0.05 * torch.randn(NUM_SAMPLES, 1, generator=gen)
    return x, y


def build_model() -> nn.Module:
    return nn.Sequential(nn.Linear(NUM_FEATURES, 64), nn.ReLU(), nn.Dropout(0.2), nn.Linear(64, 1))


def train(ctx: ddpflow.TrainContext, epochs: int, lr: float = 0.01) -> list[float]:
    """The validation loss of every epoch (ddpflow.fit's history covers restarts too)."""
    x, y = make_data()
    split = NUM_SAMPLES * 3 // 4
    torch.manual_seed(0)  # the same initial weights on every rank
    net = build_model()
    history = ddpflow.fit(
        ctx,
        model=ctx.wrap(net),
        optimizer=torch.optim.Adam(net.parameters(), lr=lr),
        train=ddpflow.TensorPairs(x[:split], y[:split]),
        val=ddpflow.TensorPairs(x[split:], y[split:]),
        epochs=epochs,
        batch_size=32,
        hooks=ddpflow.FitHooks(loss=nn.functional.mse_loss),
        log_every_steps=5,
        checkpoint_every_steps=5,
    )
    return [stats.val_loss for stats in history]


def main() -> None:
    with (
        distributed.LocalCluster(n_workers=2, threads_per_worker=1) as cluster,
        distributed.Client(cluster) as client,
        tempfile.TemporaryDirectory() as checkpoints,
    ):
        val_losses = ddpflow.run(
            client, train, 4, world_size=2, checkpoint_dir=checkpoints, on_progress=print
        )
        model = build_model()
        loaded = ddpflow.load_checkpoint(checkpoints, model=model)
    print(f"validation loss per epoch: {', '.join(f'{v:.4f}' for v in val_losses)}")
    print(f"final checkpoint: step {loaded.step} of {loaded.uri}")


if __name__ == "__main__":
    main()
