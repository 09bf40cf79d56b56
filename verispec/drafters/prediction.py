"""Predicted outputs (OpenAI's `prediction`): text the caller expects most of the answer to be
(the file being edited, the paragraph being rewritten) is the draft.

The drafter follows where the output is in the prediction: while the committed tokens agree with
it, the draft is what comes next there; after a disagreement (an edit), it re-aligns on the
output's last tokens, at their nearest occurrence after the last agreed place (else the nearest
before it), as prompt lookup would but within the prediction alone. Deterministic: one-hot q.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from verispec.core.errors import VerispecError
from verispec.core.types import DraftSource, Proposal
from verispec.drafters.base import Drafter, DraftRequest, Wrapper

PREDICTION_K = 16  # most prediction tokens drafted per step


def realign(prediction: list[int], output: list[int], near: int, max_ngram: int = 4) -> int | None:
    """Where the output continues in the prediction after an edit: the end of the latest
    occurrence-nearest-`near` of the output's last n tokens (n from max_ngram down to 1; an
    occurrence ending at or after `near` first). None: no n-gram of the output's tail occurs.

    Example: prediction [5, 6, 7, 8, 9], output [.., 4, 7] (7 replaced 6), near 2 -> 3 (draft 8).
    """
    for n in range(min(max_ngram, len(output)), 0, -1):
        tail = output[-n:]
        ends = [i + n for i in range(len(prediction) - n) if prediction[i: i + n] == tail]
        if ends:
            after = [end for end in ends if end >= near]
            return min(after) if after else max(ends)
    return None


class PredictionDrafter(Drafter):
    """Drafts up to max_k tokens of `prediction` (token ids) where the output is in it."""

    def __init__(self, prediction: list[int], max_k: int = PREDICTION_K) -> None:
        if not prediction:
            raise VerispecError("the prediction is empty: give the text the output is expected to be")
        self.prediction = list(prediction)
        self.max_k = max_k
        self.reset()

    def reset(self) -> None:
        self._start: int | None = None  # where the output starts in the context
        self._seen = 0  # context tokens followed so far
        self._at: int | None = 0  # where the output is in the prediction (None: lost)
        self._last = 0  # the last place the output agreed with the prediction

    def propose(self, request: DraftRequest) -> Proposal:
        context = request.tokens.tolist()
        if self._start is None:
            self._start = self._seen = len(context)
        for token in context[self._seen:]:  # follow the tokens committed since the last step
            at = self._at
            if at is not None and at < len(self.prediction) and self.prediction[at] == token:
                self._at += 1
                self._last = self._at
            else:
                self._at = None
        self._seen = len(context)
        if self._at is None:
            self._at = realign(self.prediction, context[self._start:], self._last)
        k = min(request.k, self.max_k)
        draft = [] if self._at is None else self.prediction[self._at: self._at + k]
        return Proposal(torch.tensor(draft, dtype=torch.int64, device=request.tokens.device))

    def commit(self, num_accepted: int) -> None:
        pass  # the committed tokens are followed at the next step, from the context


class PredictionFirst(Wrapper):
    """The caller's prediction drafted first wherever the output is in it (as long a draft as the
    step's room allows, up to PREDICTION_K), the sequence's own drafter (None: none) elsewhere.
    Only the drafter that proposed is told what the target kept; a stateful drafter (a KV cache)
    catches up on the steps it sat out at its next proposal."""

    def __init__(self, prediction: list[int], drafter: Drafter | None) -> None:
        super().__init__(drafter)
        self.prediction = PredictionDrafter(prediction)
        self.last: Drafter | None = None  # the drafter whose proposal is being verified

    def reset(self) -> None:
        super().reset()
        self.prediction.reset()
        self.last = None

    def propose(self, request: DraftRequest) -> Proposal:
        proposal = self.prediction.propose(replace(request, k=request.limit))
        if len(proposal):
            self.last = self.prediction
            return replace(proposal, source=DraftSource.PREDICTION)
        if self.drafter is None or request.k < 1:
            self.last = None
            return proposal
        self.last = self.drafter
        return self.drafter.propose(request)

    def commit(self, num_accepted: int) -> None:
        if self.last is not None:
            self.last.commit(num_accepted)
