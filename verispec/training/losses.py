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


def distill_loss(student_logits: torch.Tensor, teacher_logits: torch.Tensor, kind: str = "fkl",
                 mask: torch.Tensor | None = None) -> torch.Tensor:
    """student_logits, teacher_logits: [..., vocab]; mask: [...] bool. Returns a scalar.

    >>> p = torch.tensor([[2.0, 0.0]]); distill_loss(p, p, "tvd").item()
    0.0
    """
    log_q = F.log_softmax(student_logits.float(), -1)
    log_p = F.log_softmax(teacher_logits.float(), -1)
    if kind == "fkl":
        per_position = (log_p.exp() * (log_p - log_q)).sum(-1)
    elif kind == "rkl":
        per_position = (log_q.exp() * (log_q - log_p)).sum(-1)
    elif kind == "tvd":
        per_position = 0.5 * (log_p.exp() - log_q.exp()).abs().sum(-1)
    else:
        raise ValueError(f"unknown distillation loss {kind!r}; choose fkl, rkl or tvd")
    return _masked_mean(per_position, mask)


LOSSES = ("fkl", "rkl", "tvd")


def feature_loss(predicted: torch.Tensor, actual: torch.Tensor,
                 mask: torch.Tensor | None = None) -> torch.Tensor:
    """Smooth L1 between predicted and actual hidden states [..., hidden], as EAGLE trains."""
    per_position = F.smooth_l1_loss(predicted.float(), actual.float(), reduction="none").mean(-1)
    return _masked_mean(per_position, mask)


def agreement(name: str, student: torch.Tensor, teacher: torch.Tensor, mask: torch.Tensor,
              answer: torch.Tensor) -> dict[str, float]:
    """Top-1 agreement over every real position (`name`, what the loss covers) and over the
    answer's only (`name_answer`, what decoding drafts). student, teacher: [B, T, vocab];
    mask, answer: [B, T] bool."""
    same = student.argmax(-1) == teacher.argmax(-1)  # [B, T], each argmax taken once

    def rate(where: torch.Tensor) -> float:
        return float((same & where).sum() / where.sum().clamp_min(1))

    return {name: rate(mask), f"{name}_answer": rate(mask & answer)}


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
