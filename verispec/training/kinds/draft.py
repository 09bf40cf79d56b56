"""The distilled draft model: a small student of the target's own embeddings and a few decoder
layers, trained on the target's distributions."""

from __future__ import annotations

import torch

from verispec.drafters.distilled import DraftStudent, draft_settings
from verispec.training.data import Sequence
from verispec.training.shell import Batch, Built, Kind, Recipe


def build(recipe: Recipe, meta: dict, sequences: list[Sequence]) -> Built:
    layers = recipe.options.draft_layers
    return draft_settings(layers), DraftStudent(recipe.target, layers).float()


def loss(recipe: Recipe, b: Batch) -> tuple[torch.Tensor, dict]:
    return recipe.head_distillation(recipe.module(b.tokens), b)


KIND = Kind(DraftStudent.kind, build, loss, frozenset({"draft_layers"}), prefix="student.",
            reduced_vocab=False)
