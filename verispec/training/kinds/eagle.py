"""EAGLE: a feature-level drafter; position i maps (h_i, x_{i+1}) to h_{i+1}, trained on feature
regression plus the target's distribution, unrolled on its own predicted features."""

from __future__ import annotations

import torch

from verispec.drafters.eagle import EagleDrafter, EagleNet, eagle_settings
from verispec.training.data import Sequence
from verispec.training.losses import agreement_rates, feature_loss, head_distillation
from verispec.training.shell import Batch, Built, Kind, Recipe


def build(recipe: Recipe, meta: dict, sequences: list[Sequence]) -> Built:
    settings = eagle_settings(recipe.target)
    if recipe.options.mid_state:
        settings["mid_layer"] = int(meta["exit_layer"])
    return settings, EagleNet(**settings)


def loss(recipe: Recipe, b: Batch) -> tuple[torch.Tensor, dict]:
    # Position i: (h_i, x_{i+1}) -> h_{i+1}. Unrolled step s feeds back the step s-1 predictions.
    # A predicted feature has no mid-layer state: from step 2 on, mid is None (zeros).
    options = recipe.options
    mask, answer = b.mask[:, 1:], b.answer[:, 1:]
    actual = b.hidden[:, 1:]
    features = b.hidden[:, :-1]
    mid = b.exit_hidden[:, :-1] if recipe.module.mid_layer is not None else None
    total, metrics = 0.0, {}
    for step in range(options.unroll):
        width = features.shape[1]
        embeds = recipe.embed[b.tokens[:, step + 1: step + 1 + width]]
        predicted = recipe.module(embeds, features, torch.arange(width, device=b.tokens.device), mid=mid)
        mid = None
        m = mask[:, step: step + width]
        # the real positions' rows only [N, hidden]: padding never reaches the head
        kept, target_h = predicted[m], actual[:, step: step + width][m]
        tokens, same = head_distillation(kept, target_h, recipe.head_t, options.loss)
        total = total + options.feature_weight * feature_loss(kept, target_h) + 0.1 * tokens
        metrics.update(agreement_rates(f"top1_step{step + 1}", same, answer[:, step: step + width][m]))
        features = predicted[:, :-1]  # predicted h_{i+1}, paired next with x_{i+2}
    metrics["loss"] = float(total.detach())
    return total, metrics


KIND = Kind(EagleDrafter.kind, build, loss, frozenset({"unroll", "feature_weight", "mid_state"}))
