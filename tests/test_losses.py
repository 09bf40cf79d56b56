"""The distillation losses against values worked out by hand."""

from __future__ import annotations

import math

import pytest
import torch

from verispec.training import trainer
from verispec.training.losses import distill_loss, feature_loss, top1_agreement

P = torch.tensor([0.5, 0.5])
Q = torch.tensor([0.9, 0.1])


def logits(probs: torch.Tensor) -> torch.Tensor:
    return probs.log()


def test_losses_match_hand_computed_values():
    fkl = 0.5 * math.log(0.5 / 0.9) + 0.5 * math.log(0.5 / 0.1)
    rkl = 0.9 * math.log(0.9 / 0.5) + 0.1 * math.log(0.1 / 0.5)
    assert distill_loss(logits(Q), logits(P), "fkl").item() == pytest.approx(fkl, rel=1e-5)
    assert distill_loss(logits(Q), logits(P), "rkl").item() == pytest.approx(rkl, rel=1e-5)
    assert distill_loss(logits(Q), logits(P), "tvd").item() == pytest.approx(0.4, rel=1e-5)


@pytest.mark.parametrize("kind", ["fkl", "rkl", "tvd"])
def test_losses_vanish_only_at_the_teacher(kind):
    teacher = torch.randn(5, 11)
    assert distill_loss(teacher, teacher, kind).item() == pytest.approx(0, abs=1e-6)
    assert distill_loss(teacher + torch.randn(5, 11), teacher, kind).item() > 1e-3


def test_mask_leaves_out_positions():
    student, teacher = torch.randn(2, 3, 7), torch.randn(2, 3, 7)
    mask = torch.tensor([[True, False, False], [False, False, False]])
    assert distill_loss(student, teacher, "tvd", mask).item() == pytest.approx(
        distill_loss(student[0, :1], teacher[0, :1], "tvd").item(), rel=1e-6)
    assert top1_agreement(teacher, teacher, mask) == 1.0
    assert feature_loss(teacher, teacher + 1, mask).item() == pytest.approx(0.5)


def test_unknown_loss_is_refused():
    with pytest.raises(ValueError, match="unknown distillation loss"):
        distill_loss(P, P, "mse")


@pytest.mark.parametrize("flags, fast", [({"avx2", "avx512f"}, False), ({"avx512_bf16"}, True),
                                         ({"amx_bf16", "avx2"}, True), (set(), False)])
def test_bf16_autocast_only_where_the_cpu_has_it(monkeypatch, flags, fast):
    monkeypatch.setattr(trainer, "cpu_flags", lambda: flags)
    assert trainer.bf16_is_fast("cpu") is fast
    assert trainer.bf16_is_fast("cuda") and not trainer.bf16_is_fast("mps")
