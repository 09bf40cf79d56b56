"""Greedy verification: keep draft tokens while they equal the target's argmax (chains and trees)."""

from __future__ import annotations

import torch

from verispec.core.argmax import argmax
from verispec.core.tree import is_chain
from verispec.core.types import Proposal, SamplingParams, Verdict
from verispec.verifiers.tree import greedy_tree_accept


def greedy_accept(draft_tokens: torch.Tensor, target_logits: torch.Tensor) -> tuple[int, int]:
    """Longest prefix of the draft that matches the target's argmax, and the token after it.

    draft_tokens: [k]; target_logits: [k + 1, vocab] (row i scores the token at draft position i,
    row k is the bonus position). Returns (num_accepted, next_token).

    Example: draft [5, 7, 9], target argmax [5, 7, 3, 4] -> (2, 3): 5 and 7 are kept, 3 corrects 9.
    """
    k = draft_tokens.shape[0]
    # One host sync for the whole step, and three tensor ops: right after a forward, whose weights
    # swept the caches, each op cost ~20 us on the 4-bit target's CPU (docs/kernels.md, "The argmax").
    both = torch.cat([draft_tokens, argmax(target_logits).to(draft_tokens.dtype)]).tolist()  # [2k + 1]
    drafted, best = both[:k], both[k:]
    num_accepted = 0
    while num_accepted < k and drafted[num_accepted] == best[num_accepted]:
        num_accepted += 1
    return num_accepted, best[num_accepted]


class GreedyVerifier:
    """Exact under greedy decoding: the output is the target's own argmax sequence."""

    lossless = True

    def verify(self, proposal: Proposal, target_logits: torch.Tensor, sampling: SamplingParams,
               generator: torch.Generator | None) -> Verdict:
        # target_logits: [len(proposal) + 1, vocab]
        if is_chain(proposal.parents):
            num_accepted, token = greedy_accept(proposal.tokens, target_logits)
            return Verdict(tuple(range(num_accepted)), token)
        path, token = greedy_tree_accept(proposal.tokens, proposal.parents, target_logits)
        return Verdict(tuple(path), token)
