"""Forcing drafters for the equality tests: they make every acceptance pattern happen."""

from __future__ import annotations

import torch

from verispec.drafters.base import DraftRequest
from verispec.types import Proposal


class RandomDrafter:
    """Uniformly random tokens: almost never accepted under greedy verification."""

    def __init__(self, vocab: int, seed: int = 0) -> None:
        self.vocab = vocab
        self.generator = torch.Generator().manual_seed(seed)

    def reset(self) -> None:
        pass

    def propose(self, request: DraftRequest) -> Proposal:
        return Proposal(torch.randint(0, self.vocab, (request.k,), generator=self.generator))

    def commit(self, num_accepted: int) -> None:
        pass


class OracleDrafter:
    """Knows the true continuation and corrupts it at chosen absolute output positions.

    With errors at positions E, a draft starting at output position s is correct up to the first
    e in E with e >= s: partial acceptance, exactly where the test wants it.
    """

    def __init__(self, prompt_length: int, truth: list[int], errors: set[int], vocab: int) -> None:
        self.prompt_length = prompt_length
        self.truth = truth
        self.errors = errors
        self.vocab = vocab
        self.proposals = 0

    def reset(self) -> None:
        self.proposals = 0

    def propose(self, request: DraftRequest) -> Proposal:
        start = request.tokens.shape[0] - self.prompt_length
        tokens = [self.truth[i] if i < len(self.truth) else 0 for i in range(start, start + request.k)]
        tokens = [(t + 1) % self.vocab if start + j in self.errors else t for j, t in enumerate(tokens)]
        self.proposals += 1
        return Proposal(torch.tensor(tokens))

    def commit(self, num_accepted: int) -> None:
        pass
