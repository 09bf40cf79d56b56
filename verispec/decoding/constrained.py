"""A grammar around a sequence's drafter, verifier and stopping rules (verispec.core.grammar).

The engine's row knows nothing of grammars: a constrained sequence gets three wrappers sharing
one grammar state (`constrain`), each doing the grammar's part where it belongs:

- drafting (`GrammarDrafter`): the tokens the grammar forces are the step's draft, proposed for
  free; otherwise the sequence's own draft, cut where it leaves the grammar (q renormalized over
  the allowed tokens: exact), and the masks of the tokens allowed after each draft node;
- verification (`MaskedVerifier`): the target's logits masked by those masks, then the
  sequence's own acceptance rule: the constrained target is its own distribution masked;
- stopping (`GrammarStop`): the kept tokens advance the grammar, which ends the sequence once
  nothing more may follow.
"""

from __future__ import annotations

import torch

from verispec.core.grammar import Constraint, apply_masks
from verispec.core.stopping import StoppingRules
from verispec.core.types import DraftSource, Proposal, SamplingParams, Verdict
from verispec.drafters.base import Drafter, DraftRequest, Wrapper
from verispec.verifiers import Verifier


class GrammarState:
    """One sequence's grammar and the masks of its current draft [1 + k, vocab] (None before
    the first draft)."""

    def __init__(self, constraint: Constraint) -> None:
        self.constraint = constraint
        self.masks: torch.Tensor | None = None


class GrammarDrafter(Wrapper):
    """Forced tokens first, else `drafter`'s proposal (None: no drafter) cut to the grammar."""

    def __init__(self, state: GrammarState, drafter: Drafter | None) -> None:
        super().__init__(drafter)
        self.state = state
        self.asked = False  # whether `drafter` proposed this step (it is then told what was kept)

    def reset(self) -> None:
        self.state.constraint.reset()
        super().reset()

    def propose(self, request: DraftRequest) -> Proposal:
        constraint = self.state.constraint
        forced = constraint.forced()[: request.limit]
        self.asked = not forced and self.drafter is not None and (request.k >= 1 or self.drafter.uses_room)
        if forced:
            proposal = Proposal(torch.tensor(forced, dtype=torch.int64, device=request.tokens.device),
                                source=DraftSource.GRAMMAR)
        elif self.asked:
            proposal = self.drafter.propose(request)
        else:
            proposal = Proposal(request.tokens[:0])
        proposal, self.state.masks = constraint.cut(proposal)
        return proposal

    def commit(self, num_accepted: int) -> None:
        if self.asked:
            self.drafter.commit(num_accepted)


class MaskedVerifier:
    """`verifier` on the target's logits masked to what the grammar allows at each block row."""

    def __init__(self, state: GrammarState, verifier: Verifier) -> None:
        self.state = state
        self.verifier = verifier
        self.lossless = verifier.lossless

    def verify(self, proposal: Proposal, target_logits: torch.Tensor, sampling: SamplingParams,
               generator: torch.Generator | None) -> Verdict:
        """target_logits: [len(proposal) + 1, vocab]."""
        masked = apply_masks(target_logits, self.state.masks.to(target_logits.device))
        return self.verifier.verify(proposal, masked, sampling, generator)


class GrammarStop:
    """`rules`, then the grammar: the kept tokens advance it, and a complete grammar ends the
    sequence after the token that completed it."""

    def __init__(self, state: GrammarState, rules: StoppingRules) -> None:
        self.state = state
        self.rules = rules
        self.max_new_tokens = rules.max_new_tokens

    def cut(self, generated: list[int], block: list[int]) -> tuple[int, bool]:
        keep, finished = self.rules.cut(generated, block)
        complete = self.state.constraint.commit(block[:keep])
        return (complete, True) if complete is not None else (keep, finished)


def constrain(constraint: Constraint, drafter: Drafter | None, verifier: Verifier,
              rules: StoppingRules) -> tuple[GrammarDrafter, MaskedVerifier, GrammarStop]:
    """A sequence's drafter, verifier and stopping rules, each wrapped to follow `constraint`."""
    state = GrammarState(constraint)
    return GrammarDrafter(state, drafter), MaskedVerifier(state, verifier), GrammarStop(state, rules)
