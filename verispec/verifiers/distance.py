"""Distance acceptance ("tv:X"): LOSSY. A draft token is kept outright where the draft's and the
target's distributions at its position are within total variation X; elsewhere the exact rule
decides.

At a position i with TV(p_i, q_i) = 0.5 * sum |p_i - q_i| <= X the drafted token x is accepted
whenever p_i(x) > 0 (the output then follows q_i there, within X of p_i); at the first position
above X, exact speculative sampling runs as usual (accept with min(1, p/q), else resample from
norm(max(0, p - q))), and a fully accepted chain ends with a bonus token from p. X = 0 is the
exact rule (TV 0 means p = q, where the exact rule accepts anyway). A deterministic drafter's q is
one-hot, so its token is kept where p_i(x) >= 1 - X. Token trees are verified exactly.

What it costs in quality is measured, not assumed: scripts/lossy_curve.py, docs/lossy.md.
"""

from __future__ import annotations

import torch

from verispec.core.errors import VerispecError
from verispec.core.sampling import warp_probs
from verispec.core.tree import is_chain
from verispec.core.types import Proposal, SamplingParams, Verdict
from verispec.verifiers.rejection import RejectionVerifier, rejection_sample

PREFIX = "tv:"


def tv_threshold(acceptance: str) -> float | None:
    """X of an acceptance rule "tv:X" (None for any other rule); a bad X is a clear error."""
    if not acceptance.startswith(PREFIX):
        return None
    try:
        threshold = float(acceptance[len(PREFIX):])
    except ValueError:
        raise VerispecError(f"acceptance {acceptance!r}: tv:X takes a number X in [0, 1]") from None
    if not 0 <= threshold <= 1:
        raise VerispecError(f"acceptance {acceptance!r}: the total-variation threshold X must be in [0, 1]")
    return threshold


def distance_accept(draft_tokens: torch.Tensor, draft_probs: torch.Tensor | None,
                    target_probs: torch.Tensor, threshold: float,
                    generator: torch.Generator | None) -> tuple[int, int]:
    """draft_tokens: [k]; draft_probs: [k, vocab] or None (one-hot); target_probs: [k + 1, vocab].
    Returns (number accepted, next token)."""
    k, vocab = draft_tokens.shape[0], target_probs.shape[-1]
    q = (torch.nn.functional.one_hot(draft_tokens, vocab).to(target_probs.dtype) if draft_probs is None
         else draft_probs)  # [k, vocab]
    close = 0.5 * (target_probs[:k] - q).abs().sum(-1) <= threshold  # [k]
    # Where the two are close, the exact rule is handed p as q: it then keeps x whenever p(x) > 0.
    q = torch.where(close[:, None], target_probs[:k], q)
    accepted, token = rejection_sample(draft_tokens[None], q[None], target_probs[None], generator)
    return int(accepted), int(token)


class DistanceVerifier:
    """Lossy "tv:X" acceptance over chains (trees: the exact rule)."""

    lossless = False

    def __init__(self, threshold: float) -> None:
        self.threshold = threshold

    def verify(self, proposal: Proposal, target_logits: torch.Tensor, sampling: SamplingParams,
               generator: torch.Generator | None) -> Verdict:
        # target_logits: [len(proposal) + 1, vocab]
        if not is_chain(proposal.parents):
            return RejectionVerifier().verify(proposal, target_logits, sampling, generator)
        n, token = distance_accept(proposal.tokens, proposal.draft_probs,
                                   warp_probs(target_logits, sampling), self.threshold, generator)
        return Verdict(tuple(range(n)), token)
