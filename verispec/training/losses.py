"""Distillation losses: pure functions of logits, averaged over positions where mask is true.

Vocabulary: teacher = the target's distribution p, student = the drafter's q.
  forward KL  KL(p || q) = sum p (log p - log q)   mass-covering: q spreads over p's support
  reverse KL  KL(q || p) = sum q (log q - log p)   mode-seeking: q concentrates on p's mode
  TVD         0.5 sum |p - q|                     what acceptance depends on: alpha = 1 - TVD
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.nn import functional as F


def _masked_mean(values: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    if mask is None:
        return values.mean()
    mask = mask.to(values.dtype)
    return (values * mask).sum() / mask.sum().clamp_min(1)


LOSSES = ("fkl", "rkl", "tvd")


def check_loss(kind: str) -> None:
    """Refuse a distillation loss that is not one of LOSSES."""
    if kind not in LOSSES:
        raise ValueError(f"unknown distillation loss {kind!r}; choose fkl, rkl or tvd")


def _wide(x: torch.Tensor) -> torch.Tensor:
    """x in float32 at least (bfloat16 logits are widened; float64 stays, for gradcheck)."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


class _ForwardKL(torch.autograd.Function):
    """KL(p || softmax(z)) of each row, its gradient in z fused: softmax(z) - p.

    Through log_softmax, exp, sub and mul, autograd passes over the [rows, vocab] logits many
    times, which on a CPU cost more than the drafter's own matrix products (docs/training.md,
    "What a training step costs"); this takes fewer, the gradient in one expression.
    z: [N, V] student logits (any float dtype); p: [N, V] teacher probabilities, plogp: [N] the
    sum of p log p, both as wide as z's float32 form. Returns [N] in that dtype.
    """

    @staticmethod
    def forward(ctx, z: torch.Tensor, p: torch.Tensor, plogp: torch.Tensor) -> torch.Tensor:
        zf = _wide(z)
        lse = torch.logsumexp(zf, -1)  # [N]
        ctx.save_for_backward(zf, p, lse)
        ctx.dtype = z.dtype
        # sum p (log p - log q) with log q = z - lse and sum p = 1
        return plogp - torch.linalg.vecdot(p, zf) + lse

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        zf, p, lse = ctx.saved_tensors
        return torch.exp(zf - lse[:, None]).sub_(p).mul_(grad[:, None]).to(ctx.dtype), None, None


def distill_loss(student_logits: torch.Tensor, teacher_logits: torch.Tensor, kind: str = "fkl",
                 mask: torch.Tensor | None = None) -> torch.Tensor:
    """student_logits, teacher_logits: [..., vocab]; mask: [...] bool. Returns a scalar: the mean
    over the positions mask keeps (over all where it is None; 0 where it keeps none).

    >>> p = torch.tensor([[2.0, 0.0]]); distill_loss(p, p, "tvd").item()
    0.0
    """
    check_loss(kind)
    if mask is not None:  # only the kept rows: padding costs nothing
        student_logits, teacher_logits = student_logits[mask], teacher_logits[mask]
    vocab = student_logits.shape[-1]
    per_position = distill_rows(student_logits.reshape(-1, vocab), teacher_logits.reshape(-1, vocab), kind)
    return per_position.sum() / max(1, len(per_position))


def distill_rows(student_logits: torch.Tensor, teacher_logits: torch.Tensor, kind: str) -> torch.Tensor:
    """The distillation loss of each row: student_logits, teacher_logits [N, vocab] -> [N], in
    float32 at least."""
    log_p = F.log_softmax(_wide(teacher_logits), -1)
    if kind == "fkl":
        p = log_p.exp()
        return _ForwardKL.apply(student_logits, p, (p * log_p).sum(-1))
    log_q = F.log_softmax(_wide(student_logits), -1)
    if kind == "rkl":
        return (log_q.exp() * (log_q - log_p)).sum(-1)
    return 0.5 * (log_p.exp() - log_q.exp()).abs().sum(-1)


class _HeadDistillation(torch.autograd.Function):
    """The distillation loss of a student read through a frozen head, row block by row block.

    Whole, the student's and teacher's logits and every elementwise step of the loss and its
    gradient are [N, vocab] tensors written to memory and read back; in blocks of `rows` rows they
    are a block's size. The loss ends the graph, so the gradient in the student's states is taken
    block by block in the forward pass and backward only scales it. Same loss, same gradient
    (docs/training.md, "What a training step costs").
    """

    @staticmethod
    def forward(ctx, student: torch.Tensor, teacher: torch.Tensor, head_t: torch.Tensor, kind: str,
                rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        # student, teacher: [N, hidden]; head_t: [hidden, vocab]
        # -> (per-row loss [N] in float32 at least, student's top token [N], teacher's [N])
        losses = torch.empty(len(student), dtype=torch.promote_types(student.dtype, torch.float32),
                             device=student.device)
        top_s, top_t = (torch.empty(len(student), dtype=torch.int64, device=student.device)
                        for _ in range(2))
        grad = torch.zeros_like(student) if ctx.needs_input_grad[0] else None
        device = student.device.type
        if torch.is_autocast_enabled(device):  # cast once, not once a block
            head_t = head_t.to(torch.get_autocast_dtype(device))
        for start in range(0, len(student), rows):
            block = slice(start, start + rows)
            with torch.enable_grad():
                s = student[block].detach().requires_grad_(grad is not None)
                z_s, z_t = s @ head_t, teacher[block] @ head_t  # [rows, vocab]
                per_row = distill_rows(z_s, z_t, kind)
                if grad is not None:
                    grad[block] = torch.autograd.grad(per_row.sum(), s)[0]
            losses[block] = per_row.detach()
            top_s[block], top_t[block] = z_s.max(-1).indices, z_t.max(-1).indices
        ctx.save_for_backward(grad)
        ctx.mark_non_differentiable(top_s, top_t)
        return losses, top_s, top_t

    @staticmethod
    def backward(ctx, grad_losses: torch.Tensor, *_: torch.Tensor) -> tuple:
        (grad,) = ctx.saved_tensors
        return grad * grad_losses[:, None].to(grad.dtype), None, None, None, None


def head_distillation(student: torch.Tensor, teacher: torch.Tensor, head_t: torch.Tensor,
                      kind: str = "fkl", rows: int = 256) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean distillation loss, top-1 agreement per row [N] bool) of student states [N, hidden]
    read through the frozen head head_t [hidden, vocab], against the teacher's states [N, hidden]
    through the same head: distill_loss(student @ head_t, teacher @ head_t, kind) without the
    [N, vocab] logits ever in memory at once."""
    check_loss(kind)
    losses, top_s, top_t = _HeadDistillation.apply(student, teacher, head_t, kind, rows)
    return losses.sum() / max(1, len(losses)), top_s == top_t


def feature_loss(predicted: torch.Tensor, actual: torch.Tensor,
                 mask: torch.Tensor | None = None) -> torch.Tensor:
    """Smooth L1 between predicted and actual hidden states [..., hidden], as EAGLE trains."""
    per_position = F.smooth_l1_loss(predicted.float(), actual.float(), reduction="none").mean(-1)
    return _masked_mean(per_position, mask)


def agreement(name: str, student: torch.Tensor, teacher: torch.Tensor, mask: torch.Tensor,
              answer: torch.Tensor) -> dict[str, float]:
    """Top-1 agreement over every real position (`name`, what the loss covers) and over the
    answer's only (`name_answer`, what decoding drafts). student, teacher: [..., vocab];
    mask, answer: [...] bool."""
    student, teacher, answer = student[mask], teacher[mask], answer[mask]
    # max's indices: the first maximum, as argmax's, in half the time on a CPU
    return agreement_rates(name, student.max(-1).indices == teacher.max(-1).indices, answer)


def agreement_rates(name: str, same: torch.Tensor, answer: torch.Tensor) -> dict[str, float]:
    """agreement's two rates from each real position's top-1 match same [N] bool and whether it
    drafts an answer token, answer [N] bool."""
    return {name: float(same.float().mean()) if len(same) else 0.0,
            f"{name}_answer": float((same & answer).sum() / answer.sum().clamp_min(1))}


def multi_head_backward(trunk_out: torch.Tensor, head_losses: list[Callable[[torch.Tensor], torch.Tensor]],
                        sequential: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Backpropagate the sum of several heads' losses on one trunk output trunk_out [..., hidden].

    sequential (Gloeckle et al. 2024, multi-token prediction): trunk_out is detached into a leaf,
    then each head in turn runs forward, loss and backward into that leaf, so its activations and
    logits are freed before the next head runs: peak memory holds one head's, not all of them.
    The leaf accumulates every head's gradient; that sum then flows into the trunk once, where
    trunk_out has a graph or requires a gradient (a frozen trunk's output needs none). With
    sequential False, the reference order: all heads' losses summed, then one backward.
    Both give the same gradients (up to float summation order). Returns (the summed loss,
    detached; the gradient accumulated at the trunk output, like trunk_out).
    """
    leaf = trunk_out.detach().requires_grad_()
    if sequential:
        total = torch.zeros((), device=trunk_out.device)
        for head_loss in head_losses:
            loss = head_loss(leaf)
            loss.backward()
            total = total + loss.detach()
    else:
        total = sum(head_loss(leaf) for head_loss in head_losses)
        total.backward()
    if trunk_out.requires_grad:
        trunk_out.backward(leaf.grad)
    return total.detach(), leaf.grad
