"""Exact speculative sampling (Leviathan et al. 2022; Chen et al. 2023).

For each draft token x at position i, accept with probability min(1, p_i(x) / q_i(x)). At the first
rejection emit a recovered token from norm(max(0, p_i - q_i)); if all k are accepted emit a bonus
token from p_k. The emitted tokens are then distributed exactly as the target's own samples.
"""

from __future__ import annotations

import torch

from verispec.core.sampling import sample, warp_probs
from verispec.core.tree import is_chain
from verispec.core.types import Proposal, SamplingParams, Verdict
from verispec.verifiers.tree import tree_rejection_sample


def rejection_sample(
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor | None,
    target_probs: torch.Tensor,
    generator: torch.Generator | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Batched exact speculative sampling.

    draft_tokens: [batch, k] int64; draft_probs: [batch, k, vocab] or None for a deterministic
    drafter (q is then one-hot on the drafted token); target_probs: [batch, k + 1, vocab].
    Returns (num_accepted [batch], next_token [batch]).

    Worked example, vocab 2, k = 1: p_0 = [0.5, 0.5], q_0 = [0.9, 0.1], draft token 0 is accepted
    with probability 0.5 / 0.9; on rejection the residual max(0, p - q) = [0, 0.4] recovers token 1.
    Token 0 then comes out with probability 0.9 * 0.5/0.9 = 0.5, as under p.
    """
    batch, k = draft_tokens.shape
    vocab = target_probs.shape[-1]
    if draft_probs is None:
        draft_probs = torch.nn.functional.one_hot(draft_tokens, vocab).to(target_probs.dtype)
    p_draft = target_probs[:, :k].gather(-1, draft_tokens.unsqueeze(-1)).squeeze(-1)  # [batch, k]
    q_draft = draft_probs.gather(-1, draft_tokens.unsqueeze(-1)).squeeze(-1)  # [batch, k]
    uniform = torch.rand(batch, k, generator=generator, device=target_probs.device)
    # u < p/q, written without a division; u in [0, 1) so p = 0 is never accepted.
    accepted = uniform * q_draft < p_draft
    num_accepted = accepted.to(torch.int64).cumprod(-1).sum(-1)  # [batch]

    rows = torch.arange(batch, device=target_probs.device)
    p_next = target_probs[rows, num_accepted]  # [batch, vocab]
    q_next = torch.cat([draft_probs, torch.zeros_like(target_probs[:, :1])], dim=1)[rows, num_accepted]
    residual = (p_next - q_next).clamp_min(0)  # q_next is 0 at the bonus position: residual = p
    mass = residual.sum(-1, keepdim=True)
    # Exact arithmetic never rejects when p == q; guard float round-off that leaves no mass.
    residual = torch.where(mass > 0, residual / mass.clamp_min(1e-30), p_next)
    return num_accepted, sample(residual, generator)


class RejectionVerifier:
    """Lossless under sampling: the output distribution equals the target's."""

    lossless = True

    def verify(self, proposal: Proposal, target_logits: torch.Tensor, sampling: SamplingParams,
               generator: torch.Generator | None) -> Verdict:
        # target_logits: [len(proposal) + 1, vocab]
        target_probs = warp_probs(target_logits, sampling)
        if not is_chain(proposal.parents):
            path, token = tree_rejection_sample(proposal.tokens, proposal.parents,
                                                proposal.draft_probs, target_probs, generator)
            return Verdict(tuple(path), token)
        draft_probs = None if proposal.draft_probs is None else proposal.draft_probs.unsqueeze(0)
        num_accepted, next_token = rejection_sample(
            proposal.tokens.unsqueeze(0), draft_probs, target_probs.unsqueeze(0), generator)
        n, t = torch.cat([num_accepted, next_token]).tolist()
        return Verdict(tuple(range(n)), t)
