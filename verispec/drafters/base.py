"""The drafter contract: propose tokens for the target to verify, then rewind own state."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from verispec.core.types import Proposal, SamplingParams


@dataclass(frozen=True)
class DraftRequest:
    """Everything a drafter may look at when proposing."""

    tokens: torch.Tensor  # [context_len] int64: prompt + every committed token
    k: int  # most tokens to propose (>= 1); a drafter may propose fewer, or none
    sampling: SamplingParams
    generator: torch.Generator | None
    # The target's final hidden state at every committed position but the last, for drafters
    # that declare `needs_hidden` (EAGLE, Medusa), followed by its residual state after the first
    # L layers for each L in the drafter's `hidden_layers` (if it has any); None for the others.
    target_hidden: torch.Tensor | None = None  # [context_len - 1, hidden * (1 + len(layers))]


class Drafter(Protocol):
    """A drafter owns its state (a KV cache, say) and keeps it in step with the committed text.

    A drafter may set a class attribute `needs_hidden = True` to receive the target's hidden
    states in DraftRequest.target_hidden, and `hidden_layers` (increasing layer counts) to receive
    intermediate states there too. A drafter that runs the target's own layers may set
    `adopts_prefill = True`: after prefilling the prompt, the engine then calls
    `adopt_prefill(target)` with its CachedModel, whose keys and values the drafter may copy
    instead of prefilling the prompt itself. A drafter whose proposals carry a side branch
    (Proposal.side: tokens scored in the same target forward, never accepted) must define
    `observe_side(logits)`: the engine calls it with their logits [m, vocab] before `commit`.
    """

    def reset(self) -> None:
        """Forget everything: a new sequence starts."""
        ...

    def propose(self, request: DraftRequest) -> Proposal:
        """Up to request.k draft tokens continuing request.tokens, with their q (or None)."""
        ...

    def commit(self, num_accepted: int) -> None:
        """The target kept the first num_accepted tokens of the last proposal; rewind the rest."""
        ...
