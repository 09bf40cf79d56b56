"""The distillation losses against values worked out by hand."""

from __future__ import annotations

import math

import pytest
import torch

from verispec.training import trainer
from verispec.training.losses import agreement, distill_loss, feature_loss

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
    assert feature_loss(teacher, teacher + 1, mask).item() == pytest.approx(0.5)


def test_agreement_counts_every_position_and_the_answers_apart():
    teacher = torch.eye(3)[None].expand(2, 3, 3)  # argmax 0, 1, 2 at the three positions
    student = torch.eye(3)[[0, 2, 2]][None].expand(2, 3, 3)  # right at positions 0 and 2 only
    mask = torch.tensor([[True, True, True], [True, True, False]])  # row 1's last is padding
    answer = torch.tensor([[False, True, True], [False, True, True]])
    assert agreement("top1", student, teacher, mask, answer) == pytest.approx(
        {"top1": 3 / 5, "top1_answer": 1 / 3})
    assert agreement("x", teacher, teacher, mask, answer) == {"x": 1.0, "x_answer": 1.0}
    assert agreement("x", student, teacher, mask, torch.zeros_like(mask))["x_answer"] == 0.0


def test_unknown_loss_is_refused():
    with pytest.raises(ValueError, match="unknown distillation loss"):
        distill_loss(P, P, "mse")


@pytest.mark.parametrize("flags, fast", [({"avx2", "avx512f"}, False), ({"avx512_bf16"}, True),
                                         ({"amx_bf16", "avx2"}, True), (set(), False)])
def test_bf16_autocast_only_where_the_cpu_has_it(monkeypatch, flags, fast):
    monkeypatch.setattr(trainer, "cpu_flags", lambda: flags)
    assert trainer.bf16_is_fast("cpu") is fast
    assert trainer.bf16_is_fast("cuda") and not trainer.bf16_is_fast("mps")
