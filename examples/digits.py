"""A digit classifier on 2 DDP ranks, written only against ddpflow's public API.

sklearn's bundled 8x8 digits (no download); run `python -m examples.digits`.
"""

from __future__ import annotations

import tempfile
from typing import Any

import distributed
import torch
from sklearn.datasets import load_digits
from torch import nn

import ddpflow


def digits() -> tuple[torch.Tensor, ...]:
    """Train and held-out parts, the same on every rank (a fixed shuffle)."""
    x, y = load_digits(return_X_y=True)
    x, y = torch.tensor(x / 16.0, dtype=torch.float32), torch.tensor(y)
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
    train, test = order[:1400], order[1400:]
    return x[train], y[train], x[test], y[test]


def build(ctx: ddpflow.TrainContext, lr: float) -> tuple[nn.Module, torch.optim.Optimizer, Any]:
    """The network, its optimizer and its LR schedule."""
    torch.manual_seed(ctx.seed)  # the same initial weights on every rank
    net = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Dropout(0.2), nn.Linear(64, 10))
    optimizer = torch.optim.SGD(net.parameters(), lr=lr, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=10, gamma=0.5)
    return net, optimizer, scheduler


def held_out_accuracy(ctx: ddpflow.TrainContext, net: nn.Module, step: int) -> float:
    """Accuracy on the held-out digits, logged as `test_accuracy` at `step`."""
    _, _, x_test, y_test = digits()
    net.eval()
    with torch.no_grad():
        accuracy = (net(x_test).argmax(1) == y_test).float().mean().item()
    ctx.log_metrics({"test_accuracy": accuracy}, step=step)
    return accuracy


def train(ctx: ddpflow.TrainContext, epochs: int, lr: float = 0.05) -> float:
    x, y, _, _ = digits()
    net, optimizer, scheduler = build(ctx, lr)
    start = ctx.resume(model=net, optimizer=optimizer, scheduler=scheduler)
    model = ctx.wrap(net)
    for epoch in range(start, epochs):
        ctx.reseed(epoch)  # dropout after a resume repeats the uninterrupted run's
        model.train()
        for index in ctx.batches(len(x), batch_size=32, epoch=epoch):
            loss = nn.functional.cross_entropy(model(x[index]), y[index])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            ctx.heartbeat()
        scheduler.step()
        ctx.log_metrics({"train_loss": loss.item()}, step=epoch + 1)
        ctx.save_checkpoint(epoch + 1, model=net, optimizer=optimizer, scheduler=scheduler)
        if ctx.is_main:
            ctx.report(f"epoch {epoch + 1}/{epochs}: last batch loss {loss.item():.3f}")
    return held_out_accuracy(ctx, net, step=epochs)


def run_digits(client: distributed.Client, checkpoint_dir: str, epochs: int = 20, **options):
    """Rank 0's held-out accuracy; `options` go to ddpflow.run (e.g. tracking_uri)."""
    return ddpflow.run(
        client, train, epochs, world_size=2, checkpoint_dir=checkpoint_dir, **options
    )


def main() -> None:
    with (
        distributed.LocalCluster(n_workers=2, threads_per_worker=1) as cluster,
        distributed.Client(cluster) as client,
        tempfile.TemporaryDirectory() as checkpoints,
    ):
        accuracy = run_digits(client, checkpoints, on_progress=print)
    print(f"held-out accuracy: {accuracy:.3f}")


if __name__ == "__main__":
    main()
