"""Names sampled with the pet-name tutorial's rule, batched: many names advance a step at a time."""

from __future__ import annotations

import torch
from torch import nn

from ddpflow.workloads.charlm.vocab import CHARACTERS, CONTEXT_LEN, PAD, STOP

MAX_NAME_LEN = 30
PAD_INDEX = CHARACTERS.index(PAD)
STOP_INDEX = CHARACTERS.index(STOP)


@torch.no_grad()
def generate_names(model: nn.Module, num_names: int, seed: int = 0) -> list[str]:
    """Sample names until the stop symbol or 30 characters, never emitting the pad symbol.

    Same rule as the tutorial's generate_name: the context is the last 8 characters left-padded
    with '*', the next symbol is drawn from the softmax over every symbol but '*'.
    """
    if num_names < 1:
        return []
    was_training = model.training
    model.eval()
    try:
        generator = torch.Generator().manual_seed(seed)
        device = next(model.parameters()).device
        context = torch.full((num_names, CONTEXT_LEN), PAD_INDEX, dtype=torch.long, device=device)
        chars: list[list[str]] = [[] for _ in range(num_names)]
        active = torch.ones(num_names, dtype=torch.bool)
        for _ in range(MAX_NAME_LEN):
            logits = model(context)[0][:, -1, :].float().cpu()
            logits[:, PAD_INDEX] = float("-inf")
            probs = torch.softmax(logits, dim=-1)
            nxt = torch.multinomial(probs, 1, generator=generator).squeeze(1)
            active &= nxt != STOP_INDEX
            for i in torch.nonzero(active).flatten().tolist():
                chars[i].append(CHARACTERS[nxt[i]])
            if not active.any():
                break
            context = torch.cat([context[:, 1:], nxt.unsqueeze(1).to(device)], dim=1)
    finally:
        model.train(was_training)
    return ["".join(c) for c in chars]
