"""Typical acceptance (Cai et al. 2024, Medusa): LOSSY. Keeps plausible drafts, not exact ones.

A draft token x is kept where the target gives it probability p(x) > min(threshold,
alpha * exp(-H(p))), H the entropy of the (warped) target distribution: confident target
distributions accept only their top tokens, flat ones accept more. Over a tree the longest path of
kept tokens wins; the token after it is sampled from the target. The output is NOT distributed as
the target's: it trades exactness for longer accepted runs, and verispec labels it lossy wherever
it can be chosen.
"""

from __future__ import annotations

import torch

from verispec.core.sampling import sample, warp_probs
from verispec.core.tree import children
from verispec.core.types import Proposal, SamplingParams, Verdict

DEFAULT_THRESHOLD = 0.09
DEFAULT_ALPHA = 0.3


def typical_tree_accept(draft_tokens: torch.Tensor, parents: torch.Tensor,
                        target_probs: torch.Tensor, generator: torch.Generator | None,
                        threshold: float = DEFAULT_THRESHOLD,
                        alpha: float = DEFAULT_ALPHA) -> tuple[list[int], int]:
    """Longest path of typical tokens, then a token sampled from the target at its end.

    draft_tokens, parents: [N]; target_probs: [N + 1, vocab]. Returns (path, next_token).

    Example: p at the root = [0.5, 0.5, 0, ...] has entropy ln 2, so the bar is
    min(0.09, 0.3 * 0.5) = 0.09 and both 0 and 1 are typical; a draft of token 2 is not.
    """
    entropy = -(target_probs * target_probs.clamp_min(1e-30).log()).sum(-1)  # [N + 1]
    bar = torch.clamp(alpha * torch.exp(-entropy), max=threshold)  # [N + 1]
    rows = parents + 1
    typical = (target_probs[rows, draft_tokens] > bar[rows]).tolist()  # [N]
    kids = children(parents.tolist())

    def longest(row: int) -> list[int]:
        best: list[int] = []
        for child in kids[row]:
            if typical[child]:
                path = [child] + longest(child + 1)
                if len(path) > len(best):
                    best = path
        return best

    path = longest(0)
    end = path[-1] + 1 if path else 0
    return path, int(sample(target_probs[end], generator))


class TypicalVerifier:
    """Lossy typical acceptance over chains and trees (sampling only)."""

    lossless = False

    def __init__(self, threshold: float = DEFAULT_THRESHOLD, alpha: float = DEFAULT_ALPHA) -> None:
        self.threshold = threshold
        self.alpha = alpha

    def verify(self, proposal: Proposal, target_logits: torch.Tensor, sampling: SamplingParams,
               generator: torch.Generator | None) -> Verdict:
        # target_logits: [len(proposal) + 1, vocab]
        path, token = typical_tree_accept(proposal.tokens, proposal.tree_parents,
                                          warp_probs(target_logits, sampling), generator,
                                          self.threshold, self.alpha)
        return Verdict(tuple(path), token)
