"""Prompt lookup decoding (Saxena 2023): copy what followed the last n-gram's earlier occurrence."""

from __future__ import annotations

import torch

from verispec.drafters.base import DraftRequest
from verispec.errors import VerispecError
from verispec.types import Proposal


def find_continuation(tokens: torch.Tensor, k: int, max_ngram: int, min_ngram: int) -> torch.Tensor:
    """Tokens that followed the most recent earlier occurrence of the context's last n-gram.

    tokens: [n]. Tries n-gram sizes from max_ngram down to min_ngram; returns up to k tokens
    ([0] when nothing matches).

    Example: tokens [1 2 3 9 1 2], n = 2: "1 2" occurred at 0, followed by [3 9 1 2] -> first k.
    """
    length = tokens.shape[0]
    for n in range(min(max_ngram, length - 1), min_ngram - 1, -1):
        windows = tokens[:-1].unfold(0, n, 1)  # [length - n, n]: every earlier n-gram
        hits = (windows == tokens[-n:]).all(-1).nonzero()
        if hits.numel():
            start = int(hits[-1]) + n
            return tokens[start:start + k]
    return tokens[:0]


class PromptLookupDrafter:
    """Deterministic and stateless: its q is one-hot, so it reports draft_probs=None."""

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise VerispecError(
                f"n-gram sizes must satisfy 1 <= min ({min_ngram}) <= max ({max_ngram})")
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram

    def reset(self) -> None:
        pass

    def propose(self, request: DraftRequest) -> Proposal:
        return Proposal(find_continuation(request.tokens, request.k, self.max_ngram, self.min_ngram))

    def commit(self, num_accepted: int) -> None:
        pass
