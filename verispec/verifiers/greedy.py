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
    target_tokens = argmax(target_logits)  # [k + 1]
    k = draft_tokens.shape[0]
    matches = (draft_tokens == target_tokens[:k]).to(torch.int64)
    num_accepted = matches.cumprod(0).sum()
    # One host sync for the whole step.
    num_accepted, next_token = torch.stack([num_accepted, target_tokens[num_accepted]]).tolist()
    return num_accepted, next_token


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
