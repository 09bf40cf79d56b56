"""verispec.core.argmax: the same indices as torch.argmax(-1) wherever it takes numpy's path
(float32 on the CPU), on the cases where two argmaxes could part: ties (the first index of the
largest value), NaNs (the first NaN counts as the largest), infinities, signed zeros, one row or
many, a strided view; and torch's own path elsewhere. The greedy verifiers read their argmax
from it, so a greedy output cannot change."""

from __future__ import annotations

import pytest
import torch

from verispec.core.argmax import argmax
from verispec.verifiers.greedy import greedy_accept
from verispec.verifiers.tree import greedy_tree_accept

NAN, INF = float("nan"), float("inf")


def hard_rows(vocab: int, rows: int, seed: int) -> torch.Tensor:
    """[rows, vocab] float32 logits full of ties: small integers, so the largest value recurs."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(-3, 4, (rows, vocab), generator=generator).float()


@pytest.mark.parametrize("rows", [1, 2, 17])
def test_ties_give_the_first_index_of_the_largest(rows):
    logits = hard_rows(49152, rows, rows)
    assert (logits == logits.max(-1, keepdim=True).values).sum(-1).min() > 1  # every row ties
    got = argmax(logits)
    assert got.dtype == torch.int64 and got.shape == (rows,)
    assert torch.equal(got, logits.argmax(-1))
    assert torch.equal(argmax(logits[0]), logits[0].argmax(-1))  # one row [vocab] -> a 0-d index


def test_nans_infinities_and_signed_zeros_as_torch_has_them():
    logits = torch.tensor([[1.0, NAN, 3.0, NAN],
                           [NAN, 2.0, NAN, INF],
                           [-INF, -INF, -INF, -INF],
                           [0.0, -0.0, 0.0, -1.0],
                           [-0.0, 0.0, -0.0, -1.0],
                           [INF, 5.0, INF, NAN],
                           [-INF, -5.0, -5.0, -INF]])
    assert argmax(logits).tolist() == logits.argmax(-1).tolist() == [1, 0, 0, 0, 0, 3, 1]


def test_a_strided_view_and_other_dtypes():
    logits = hard_rows(1000, 12, 3)
    view = logits[::3, 5:]  # not contiguous
    assert not view.is_contiguous()
    assert torch.equal(argmax(view), view.argmax(-1))
    for dtype in (torch.bfloat16, torch.float64):  # torch's own path
        assert torch.equal(argmax(logits.to(dtype)), logits.to(dtype).argmax(-1))
    with torch.inference_mode():  # the engine's logits are inference tensors
        assert torch.equal(argmax(logits), logits.argmax(-1))
    wanting = logits.clone().requires_grad_()
    assert torch.equal(argmax(wanting), logits.argmax(-1))


def test_the_greedy_verifiers_keep_the_first_of_tied_tokens():
    """Row 0 ties tokens 2 and 5 for the largest: the target's argmax is 2, so a draft of 5 is
    refused and 2 committed, in a chain and in a tree (two roots, 5 and 2: the root 2 is kept,
    then row 2, its own, ties 1 and 6)."""
    logits = torch.zeros(3, 8)
    logits[0, [2, 5]] = 1.0
    logits[1, 7] = 1.0
    logits[2, [1, 6]] = 1.0
    assert greedy_accept(torch.tensor([5, 7]), logits) == (0, 2)
    assert greedy_accept(torch.tensor([2, 7]), logits) == (2, 1)
    assert greedy_tree_accept(torch.tensor([5, 2]), torch.tensor([-1, -1]), logits) == ([1], 1)
