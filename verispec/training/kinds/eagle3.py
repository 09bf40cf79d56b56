"""EAGLE-3: reads the target's aux-layer states fused by fc, trained on the target's distribution
alone (no feature regression), with its own head over a reduced vocabulary."""

from __future__ import annotations

import torch

from verispec.drafters.eagle3 import Eagle3Drafter, Eagle3Net, eagle3_settings
from verispec.training.data import Sequence
from verispec.training.losses import agreement, distill_loss
from verispec.training.shell import Batch, Built, Kind, Recipe, require_aux


def build(recipe: Recipe, meta: dict, sequences: list[Sequence]) -> Built:
    require_aux(meta, sequences, "EAGLE-3")
    settings = eagle3_settings(recipe.target, tuple(meta["aux_layers"]), len(recipe.vocab_ids))
    module = Eagle3Net(**settings)
    with torch.no_grad():  # the target's own head, restricted: a good place to start
        module.lm_head.weight.copy_(recipe.head_t.t())
    module.lm_head.weight.requires_grad_(recipe.options.train_head)
    return settings, module


def loss(recipe: Recipe, b: Batch) -> tuple[torch.Tensor, dict]:
    # Position i: (fc(aux_i), x_{i+1}) -> o_i, whose logits should be the target's at i + 1
    # (its distribution of x_{i+2}). As EAGLE-3 trains: token loss only, no feature
    # regression. Unrolled step s feeds back the step s-1 outputs o (already H wide: no fc).
    mask, answer = b.mask[:, 1:], b.answer[:, 1:]
    teacher_all = recipe.teacher(b.hidden[:, 1:])  # [B, T - 1, reduced]
    features = recipe.module.fc(b.aux[:, :-1])
    total, metrics = 0.0, {}
    for step in range(recipe.options.unroll):
        width = features.shape[1]
        embeds = recipe.embed[b.tokens[:, step + 1: step + 1 + width]]
        output = recipe.module(embeds, features, torch.arange(width, device=b.tokens.device))
        student = recipe.module.logits(output)
        teacher, m = teacher_all[:, step: step + width], mask[:, step: step + width]
        total = total + distill_loss(student, teacher, recipe.options.loss, m)
        metrics.update(agreement(f"top1_step{step + 1}", student, teacher, m,
                                 answer[:, step: step + width]))
        features = output[:, :-1]  # o_i, paired next with x_{i+2}
    metrics["loss"] = float(total.detach())
    return total, metrics


KIND = Kind(Eagle3Drafter.kind, build, loss, frozenset({"unroll", "train_head"}), reads_aux=True,
            own_head=True)
