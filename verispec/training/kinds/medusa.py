"""Medusa: independent heads on the target's final state; head k predicts k tokens past the
target's own."""

from __future__ import annotations

import torch

from verispec.drafters.medusa import MedusaDrafter, MedusaNet, medusa_settings
from verispec.training.data import Sequence
from verispec.training.shell import Batch, Built, Kind, Recipe


def build(recipe: Recipe, meta: dict, sequences: list[Sequence]) -> Built:
    settings = medusa_settings(recipe.target, recipe.options.heads)
    return settings, MedusaNet(**settings)


def features(recipe: Recipe, b: Batch) -> torch.Tensor:
    """Every head's features at every position, before the LM head: [B, T, heads, hidden]."""
    return recipe.module(b.hidden)


def loss(recipe: Recipe, b: Batch) -> tuple[torch.Tensor, dict]:
    # Head k on h_i predicts x_{i+1+k}: its teacher is the target's distribution at i + k.
    heads = features(recipe, b)  # [B, T, heads, hidden]
    teacher_all = recipe.teacher(b.hidden)  # [B, T, reduced], computed once for every head
    total, metrics = 0.0, {}
    for k in range(1, recipe.module.num_heads + 1):
        term, agree = recipe.head_term(k, recipe.teacher(heads[:, :-k, k - 1]), teacher_all, b)
        total = total + term
        metrics.update(agree)
    metrics["loss"] = float(total.detach())
    return total, metrics


KIND = Kind(MedusaDrafter.kind, build, loss, frozenset({"heads"}), head_features=features)
