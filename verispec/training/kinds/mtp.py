"""MTP: multi-token prediction heads, each a decoder layer over the target's final states read
out through the target's final norm and LM head; trained head by head (one graph alive at once)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from verispec.drafters.mtp import MTPDrafter, MTPNet, mtp_settings, unembedding_norm
from verispec.training.data import Sequence
from verispec.training.losses import multi_head_backward
from verispec.training.shell import Batch, Built, Kind, Recipe


def build(recipe: Recipe, meta: dict, sequences: list[Sequence]) -> Built:
    unembedding_norm(recipe.target)  # a target without a final norm fails here, before training
    settings = mtp_settings(recipe.target, recipe.options.heads)
    return settings, MTPNet(**settings)


def features(recipe: Recipe, b: Batch) -> torch.Tensor:
    """Every head's features at every position, normed: [B, T, heads, hidden]."""
    norm = unembedding_norm(recipe.target)
    return norm(recipe.module(b.hidden, torch.arange(b.tokens.shape[1], device=b.tokens.device)))


def head_losses(recipe: Recipe, b: Batch) -> tuple[list[Callable[[torch.Tensor], torch.Tensor]], dict]:
    """One loss function per head of the trunk's output [B, T, hidden] (the target's final
    states), and the metrics dict they fill in as they run. Head k reads the states up to i and
    predicts x_{i+1+k}: its teacher is the target's distribution at i + k."""
    positions = torch.arange(b.tokens.shape[1], device=b.tokens.device)
    teacher_all = recipe.teacher(b.hidden)  # [B, T, reduced]
    norm = unembedding_norm(recipe.target)
    metrics: dict = {}

    def head_loss(k: int) -> Callable[[torch.Tensor], torch.Tensor]:
        def value(trunk: torch.Tensor) -> torch.Tensor:
            output = recipe.module.layers[k - 1](trunk, positions)[:, :-k]  # [B, T - k, hidden]
            term, agree = recipe.head_term(k, recipe.teacher(norm(output)), teacher_all, b)
            metrics.update(agree)
            return term
        return value

    return [head_loss(k) for k in range(1, recipe.module.num_heads + 1)], metrics


def loss(recipe: Recipe, b: Batch) -> tuple[torch.Tensor | None, dict]:
    # With gradients on: backward head by head, here (the trainer gets None to skip its own).
    losses, metrics = head_losses(recipe, b)
    if torch.is_grad_enabled():
        total, _ = multi_head_backward(b.hidden, losses)
        return None, {**metrics, "loss": float(total)}
    total = sum(term(b.hidden) for term in losses)
    return total, {**metrics, "loss": float(total)}


KIND = Kind(MTPDrafter.kind, build, loss, frozenset({"heads"}), head_features=features)
