"""A lookup (prompt lookup, suffix decoding) where the text repeats itself, a learned drafter
everywhere else.

Copying from the context is nearly free and, when an n-gram matches, usually right (summaries,
retrieval answers, code edits); a learned drafter costs a little per token and helps where
nothing matches. Suffix-matching drafts backed by a learned drafter (SAMD, Hu et al. 2024) lead
Spec-Bench for this reason. Each step takes the lookup's draft when there is one, else the
model's, and only the drafter that proposed is told what the target kept.
"""

from __future__ import annotations

from dataclasses import replace

from verispec.core.types import Proposal
from verispec.drafters.base import Drafter, DraftRequest


class LookupThenModel(Drafter):
    """Proposes the lookup's draft (up to request.k tokens) where it has one (prompt lookup: the
    context's last n-gram occurred before; suffix decoding: a continuation likely enough), else
    the model drafter's (up to min(request.k, model_k) tokens).

    A model drafter with its own state (EAGLE's KV cache) catches up on the steps it sat out at
    its next proposal, from the committed tokens and hidden states the engine hands over.
    """

    def __init__(self, lookup: Drafter, model: Drafter, model_k: int) -> None:
        self.lookup = lookup
        self.model = model
        self.model_k = model_k
        self.needs_hidden = model.needs_hidden
        self.hidden_layers = model.hidden_layers
        self.tree = model.tree
        self.last: Drafter = lookup  # the drafter whose proposal is being verified

    def reset(self) -> None:
        self.lookup.reset()
        self.model.reset()
        self.last = self.lookup

    def propose(self, request: DraftRequest) -> Proposal:
        proposal = self.lookup.propose(request)
        if proposal.tokens.numel() > 0:
            self.last = self.lookup
            return proposal
        self.last = self.model
        return self.model.propose(replace(request, k=min(request.k, self.model_k)))

    def commit(self, num_accepted: int) -> None:
        self.last.commit(num_accepted)
