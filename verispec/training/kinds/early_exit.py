"""A trained early exit: an adapter from the target's exit-layer state to its final state, read
out through the target's full LM head."""

from __future__ import annotations

import torch

from verispec.core.errors import VerispecError
from verispec.drafters.trained_exit import ExitAdapter, exit_settings, new_adapter
from verispec.training.data import Sequence
from verispec.training.shell import Batch, Built, Kind, Recipe


def build(recipe: Recipe, meta: dict, sequences: list[Sequence]) -> Built:
    exit_layer = recipe.options.exit_layer
    layer = meta["exit_layer"] if exit_layer is None else exit_layer
    if layer != meta["exit_layer"]:
        raise VerispecError(f"the data holds layer {meta['exit_layer']} states, not layer "
                            f"{layer}: rebuild it with that exit layer")
    settings = exit_settings(recipe.target, layer)
    return settings, new_adapter(recipe.target, settings)


def loss(recipe: Recipe, b: Batch) -> tuple[torch.Tensor, dict]:
    return recipe.head_distillation(recipe.module(b.exit_hidden), b)


KIND = Kind(ExitAdapter.kind, build, loss, frozenset({"exit_layer"}), prefix="adapter.",
            reduced_vocab=False, reads_exit=True)
