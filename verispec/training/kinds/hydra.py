"""Hydra: sequentially dependent heads; head k reads the target's state and the k tokens before
the one it predicts."""

from __future__ import annotations

import torch

from verispec.drafters.hydra import HydraDrafter, HydraNet, hydra_settings
from verispec.training.data import Sequence
from verispec.training.shell import Batch, Built, Kind, Recipe


def build(recipe: Recipe, meta: dict, sequences: list[Sequence]) -> Built:
    settings = hydra_settings(recipe.target, recipe.options.heads)
    return settings, HydraNet(**settings)


def loss(recipe: Recipe, b: Batch) -> tuple[torch.Tensor, dict]:
    # Head k on h_i reads x_{i+1}..x_{i+k} (the data's own tokens: teacher forcing) and
    # predicts x_{i+1+k}: its teacher is the target's distribution at i + k.
    embeds = recipe.embed[b.tokens]  # [B, T, hidden]
    teacher_all = recipe.teacher(b.hidden)  # [B, T, reduced]
    total, metrics = 0.0, {}
    for k in range(1, recipe.module.num_heads + 1):
        width = max(0, b.tokens.shape[1] - k)
        inputs = torch.cat([b.hidden[:, :width], *(embeds[:, j: j + width] for j in range(1, k + 1))],
                           dim=-1)  # [B, T - k, (k + 1) * hidden]
        term, agree = recipe.head_term(k, recipe.teacher(recipe.module.head(inputs)), teacher_all, b)
        total = total + term
        metrics.update(agree)
    metrics["loss"] = float(total.detach())
    return total, metrics


KIND = Kind(HydraDrafter.kind, build, loss, frozenset({"heads"}))
