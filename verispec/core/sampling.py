"""Pure functions: logits -> warped probabilities -> sampled tokens.

Target and drafter both go through `warp_probs` with the same SamplingParams, so p and q are the
distributions *after* temperature, top-k and top-p, as exact speculative sampling requires.
"""

from __future__ import annotations

import torch

from verispec.core.types import SamplingParams


def warp_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature, then top-k, then top-p, then softmax, in float32.

    logits: [..., vocab]. Returns probabilities [..., vocab] whose rows sum to 1. Greedy params
    give the one-hot argmax, which is what a greedy drafter must report as q.

    >>> warp_probs(torch.tensor([2.0, 1.0, 0.0]), SamplingParams(True, 1.0, top_k=2)).round(decimals=3)
    tensor([0.7310, 0.2690, 0.0000])
    """
    logits = logits.float()
    if params.greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    logits = logits / params.temperature
    if 0 < params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        sorted_probs = sorted_logits.softmax(-1)
        # Drop a token when the tokens ranked above it already hold top_p of the mass.
        mass_before = sorted_probs.cumsum(-1) - sorted_probs
        drop_sorted = mass_before >= params.top_p
        drop_sorted[..., 0] = False  # the likeliest always stays (a top_p under float32's least
        # positive value reads as 0, and 0 >= 0 would drop every token: softmax of all -inf is NaN)
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits.softmax(-1)


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
    """Draw one token per row. probs: [..., vocab] -> tokens [...] (int64)."""
    flat = probs.reshape(-1, probs.shape[-1])
    return torch.multinomial(flat, 1, generator=generator).reshape(probs.shape[:-1])
