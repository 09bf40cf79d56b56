"""Pure functions: logits -> warped probabilities -> sampled tokens.

Target and drafter both go through `warp_probs` with the same SamplingParams, so p and q are the
distributions *after* temperature, top-k and top-p, as exact speculative sampling requires.
"""

from __future__ import annotations

import torch

from verispec.core.argmax import argmax
from verispec.core.types import SamplingParams


def warp_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature, then top-k, then top-p, then softmax, in float32. Ties never split: top-k
    keeps every token tied with the k-th (as Hugging Face's), top-p every token tied with the last
    it keeps (tests/test_warps.py).

    logits: [..., vocab]. Returns probabilities [..., vocab] whose rows sum to 1. Greedy params
    give the one-hot argmax, which is what a greedy drafter must report as q.

    >>> warp_probs(torch.tensor([2.0, 1.0, 0.0]), SamplingParams(True, 1.0, top_k=2)).round(decimals=3)
    tensor([0.7310, 0.2690, 0.0000])
    """
    logits = logits.float()
    if params.greedy:
        return torch.nn.functional.one_hot(argmax(logits), logits.shape[-1]).float()
    logits = logits / params.temperature
    if 0 < params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits = torch.sort(logits, dim=-1, descending=True).values
        sorted_probs = sorted_logits.softmax(-1)
        # Keep a token while the tokens ranked above it hold less than top_p of the mass: the
        # smallest set reaching top_p. The likeliest always stays (a top_p under float32's least
        # positive value reads as 0, and would keep nothing).
        mass_before = sorted_probs.cumsum(-1) - sorted_probs
        keep_sorted = mass_before < params.top_p
        keep_sorted[..., 0] = True
        # Every token tied with the last one kept stays too: which of two equal logits the sort
        # put first must not decide (kept iff the tokens strictly likelier hold less than top_p).
        least_kept = sorted_logits.masked_fill(~keep_sorted, float("inf")).amin(-1, keepdim=True)
        logits = logits.masked_fill(logits < least_kept, float("-inf"))
    return logits.softmax(-1)


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """Draw one token per row. probs: [..., vocab] -> tokens [...] (int64)."""
    flat = probs.reshape(-1, probs.shape[-1])
    return torch.multinomial(flat, 1, generator=generator).reshape(probs.shape[:-1])
