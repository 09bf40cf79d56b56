"""The distillation losses against values worked out by hand."""

from __future__ import annotations

import math

import pytest
import torch

from verispec.training import trainer
from verispec.training.losses import agreement, distill_loss, feature_loss, head_distillation

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


def reference_loss(student_logits: torch.Tensor, teacher_logits: torch.Tensor, kind: str) -> torch.Tensor:
    """Each loss straight from its definition over whole [N, vocab] logits: the mean over rows."""
    p, q = teacher_logits.softmax(-1), student_logits.softmax(-1)
    if kind == "fkl":
        rows = (p * (p.log() - q.log())).sum(-1)
    elif kind == "rkl":
        rows = (q * (q.log() - p.log())).sum(-1)
    else:
        rows = 0.5 * (p - q).abs().sum(-1)
    return rows.mean()


@pytest.mark.parametrize("kind", ["fkl", "rkl", "tvd"])
@pytest.mark.parametrize("rows", [3, 64])
def test_head_distillation_in_blocks_matches_the_definition_and_its_gradient(kind, rows):
    # 10 rows in blocks of 3 (the last one ragged) or in one block: the loss and the gradient in
    # the student's states equal autograd through the definition over the whole logits
    torch.manual_seed(0)
    head_t = torch.randn(6, 13, dtype=torch.float64)  # [hidden, vocab]
    student = torch.randn(10, 6, dtype=torch.float64, requires_grad=True)
    teacher = student.detach() + 0.5 * torch.randn(10, 6, dtype=torch.float64)
    value, same = head_distillation(student, teacher, head_t, kind, rows)
    (grad,) = torch.autograd.grad(3.0 * value, student)
    expected = reference_loss(student @ head_t, teacher @ head_t, kind)
    (expected_grad,) = torch.autograd.grad(3.0 * expected, student)
    assert value.item() == pytest.approx(expected.item(), rel=1e-9)
    torch.testing.assert_close(grad, expected_grad, rtol=1e-9, atol=1e-12)
    assert grad.abs().max() > 1e-3  # a gradient was there to get wrong
    top = ((student @ head_t).argmax(-1) == (teacher @ head_t).argmax(-1))
    assert torch.equal(same, top) and 0 < int(same.sum()) < 10


def test_the_fused_forward_kl_passes_gradcheck():
    torch.manual_seed(1)
    student = torch.randn(4, 7, dtype=torch.float64, requires_grad=True)
    teacher = torch.randn(4, 7, dtype=torch.float64)
    mask = torch.tensor([True, False, True, True])
    assert torch.autograd.gradcheck(lambda z: distill_loss(z, teacher, "fkl", mask), (student,))


def test_head_distillation_under_bfloat16_autocast_and_without_gradients():
    torch.manual_seed(2)
    head_t = torch.randn(16, 50)
    student, teacher = torch.randn(20, 16, requires_grad=True), torch.randn(20, 16)
    exact = reference_loss(student @ head_t, teacher @ head_t, "fkl").item()
    with torch.autocast("cpu", torch.bfloat16):
        value, _ = head_distillation(student, teacher, head_t, "fkl", rows=8)
    value.backward()
    assert value.item() == pytest.approx(exact, rel=0.05) and student.grad.abs().max() > 0
    with torch.no_grad():  # evaluation: no gradient taken in the blocks
        assert head_distillation(student, teacher, head_t)[0].item() == pytest.approx(exact, rel=1e-5)


def test_unknown_loss_is_refused():
    with pytest.raises(ValueError, match="unknown distillation loss"):
        distill_loss(P, P, "mse")


@pytest.mark.parametrize("flags, fast", [({"avx2", "avx512f"}, False), ({"avx512_bf16"}, True),
                                         ({"amx_bf16", "avx2"}, True), (set(), False)])
def test_bf16_autocast_only_where_the_cpu_has_it(monkeypatch, flags, fast):
    monkeypatch.setattr(trainer, "cpu_flags", lambda: flags)
    assert trainer.bf16_is_fast("cpu") is fast
    assert trainer.bf16_is_fast("cuda") and not trainer.bf16_is_fast("mps")


@pytest.mark.parametrize("save_seconds, saved_at", [(0.0, [2, 4, 6, 7]), (3600.0, [7])])
def test_checkpoints_come_every_few_steps_but_not_more_often_than_save_seconds(
        monkeypatch, tmp_path, save_seconds, saved_at):
    """Every checkpoint_every steps and at the end; with a step far quicker than SAVE_SECONDS (a
    GPU's), only at the end."""
    saves = []
    monkeypatch.setattr(trainer, "SAVE_SECONDS", save_seconds)
    monkeypatch.setattr(trainer, "plot_history",
                        lambda history, path, title: saves.append(history[-1]["step"]))
    module = torch.nn.Linear(2, 1)
    config = trainer.TrainConfig(steps=7, warmup=1, batch_size=2, checkpoint_every=2, bf16=False)
    history = trainer.train(module, lambda batch: ((module(torch.stack(batch)) ** 2).mean(), {"loss": 1.0}),
                            [torch.ones(2), torch.zeros(2)], [], config, tmp_path)
    assert len(history) == 7 and saves == saved_at and (tmp_path / "checkpoint.pt").is_file()


def fit_history(training: list[float], held_out: dict[int, float], name: str = "top1_step1_answer"
                ) -> list[dict]:
    """A trainer history: `training[i]` the training batch's agreement at step i + 1, and the
    held-out agreement at the steps `held_out` names."""
    return [{"step": i + 1, "loss": 1.0, name: value,
             **({f"eval_{name}": held_out[i + 1], "eval_loss": 1.0} if i + 1 in held_out else {})}
            for i, value in enumerate(training)]


@pytest.mark.parametrize("training, held_out, verdict", [
    ([s / 100 for s in range(1, 31)], {10: 0.30, 20: 0.40, 30: 0.45}, "steps"),
    ([s / 100 for s in range(1, 31)], {10: 0.30, 20: 0.40, 30: 0.405}, "data"),
    ([0.5] * 30, {10: 0.30, 20: 0.40, 30: 0.405}, "neither"),
])
def test_fit_says_whether_more_steps_or_more_data_would_help(training, held_out, verdict):
    """Over the run's last third (step 20 to 30 here): held-out still rising means more steps;
    held-out flat while the training batches rise means the drafter memorises its data."""
    report = trainer.fit(fit_history(training, held_out))
    assert report["verdict"] == verdict and (report["since_step"], report["step"]) == (20, 30)
    # the training batches' mean over the 20 steps up to each evaluation (span: since's step)
    before, after = sum(training[:20]) / 20, sum(training[10:30]) / 20
    assert report["training"] == pytest.approx(after)
    assert report["training_gain"] == pytest.approx(after - before)
    assert report["held_out_gain"] == pytest.approx(held_out[30] - held_out[20])
    line = trainer.describe_fit(report)
    assert f"{held_out[30]:.3f}" in line
    assert {"steps": "more --steps should help", "data": "more data (--tokens)",
            "neither": "will not help"}[verdict] in line


def test_fit_needs_three_evaluations_of_an_agreement():
    rising = [s / 100 for s in range(1, 31)]
    assert trainer.fit(fit_history(rising, {15: 0.3, 30: 0.4})) is None
    assert trainer.fit(fit_history(rising, {10: 0.3, 20: 0.4, 30: 0.5}, name="bits")) is None
