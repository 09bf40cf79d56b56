"""Verification over a token tree: walk from the root, one accepted child per level.

Row r of target_logits / target_probs scores block row r (row 0 = the root, the last committed
token; row 1 + i = draft node i), so row r is the target's distribution for the children of r.
A chain is the tree with one child per node; the chain verifiers in greedy.py and rejection.py are
the vectorised special case of the rules here (greedy: tested to agree token for token; sampling:
both pass the distribution tests, the tree sampler on chains included).
"""

from __future__ import annotations

import torch

from verispec.core.argmax import argmax
from verispec.core.sampling import sample
from verispec.core.tree import children


def greedy_tree_accept(draft_tokens: torch.Tensor, parents: torch.Tensor,
                       target_logits: torch.Tensor) -> tuple[list[int], int]:
    """The root-to-node path whose tokens all equal the target's argmax, and the token after it.

    draft_tokens, parents: [N]; target_logits: [N + 1, vocab]. Returns (path, next_token).

    Example: parents [-1, -1, 0], tokens [4, 5, 6], argmax by row [5, 2, 6, 9]: node 1 (token 5)
    matches at the root, row 2 (node 1) wants 6 but node 1 has no children -> ([1], 6).
    """
    best = argmax(target_logits).tolist()  # one host sync for the whole step
    tokens = draft_tokens.tolist()
    kids = children(parents.tolist())
    path: list[int] = []
    row = 0
    while True:
        chosen = next((c for c in kids[row] if tokens[c] == best[row]), None)
        if chosen is None:
            return path, best[row]
        path.append(chosen)
        row = chosen + 1


def residual(target: torch.Tensor, draft: torch.Tensor) -> torch.Tensor:
    """norm(max(0, target - draft)): what is left of the target after a rejected draw from draft.

    target, draft: [vocab]. Float round-off that leaves no mass (target == draft) keeps target.
    """
    left = (target - draft).clamp_min(0)
    mass = left.sum()
    return left / mass if mass > 0 else target


def tree_rejection_sample(draft_tokens: torch.Tensor, parents: torch.Tensor,
                          draft_probs: torch.Tensor | None, target_probs: torch.Tensor,
                          generator: torch.Generator | None) -> tuple[list[int], int]:
    """Lossless multi-candidate speculative sampling over a tree (recursive rejection sampling).

    draft_tokens, parents: [N]; draft_probs: [N, vocab], row i the distribution node i was drawn
    from (given its parent and its earlier siblings), or None for a deterministic drafter (q is
    one-hot on each node's token); target_probs: [N + 1, vocab]. Returns (path, next_token).

    At a node whose target distribution is p, the children are tried in order: child c with token
    x is accepted with probability min(1, p(x) / q_c(x)); on rejection p becomes
    residual(p, q_c) and the next child is tried. If every child is rejected the next token is
    drawn from the last residual; at a leaf it is drawn from p (the bonus). Each level then emits
    a token distributed exactly as p, whatever the candidates were (SpecInfer; Yang et al. 2024
    for candidates drawn without replacement).

    Example, vocab 2, root with two deterministic children [0, 1], p = [0.3, 0.7]: child 0 is
    accepted with probability 0.3; otherwise p becomes [0, 1] and child 1 is always accepted.
    """
    vocab = target_probs.shape[-1]
    tokens = draft_tokens.tolist()
    kids = children(parents.tolist())
    uniform = torch.rand(len(tokens), generator=generator, device=target_probs.device).tolist()
    path: list[int] = []
    row = 0
    while True:
        p = target_probs[row]
        for child in kids[row]:
            if draft_probs is None:
                q = torch.nn.functional.one_hot(draft_tokens[child], vocab).to(p.dtype)
            else:
                q = draft_probs[child]
            x = tokens[child]
            # u < p/q, written without a division; u in [0, 1) so p = 0 is never accepted.
            if uniform[child] * float(q[x]) < float(p[x]):
                path.append(child)
                row = child + 1
                break
            p = residual(p, q)
        else:
            return path, int(sample(p, generator))
