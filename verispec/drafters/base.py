"""The drafter contract: propose tokens for the target to verify, then rewind own state.

Every drafter subclasses `Drafter`. What the engine and beam search may ask of one is declared
here, with defaults, as class attributes and methods; nothing is probed with getattr:

- `needs_hidden` (False): the target's final hidden states arrive in DraftRequest.target_hidden
  (EAGLE, Medusa, Hydra, MTP); `hidden_layers` (()): residual states after these layer counts
  arrive there too (EAGLE with a mid state, EAGLE-3).
- `adopts_prefill` (False): after the prompt is prefilled, `adopt_prefill(target)` hands over the
  target's cache (the self drafters).
- `uses_room` (False): asked every step, even when the policy's k is 0, and may draft up to
  DraftRequest.room (a prediction, a grammar's forced tokens).
- `batches` (False): `propose_batch` drafts several sequences' rows in one pass (model drafters).
- `forks` (False): beam search may copy its state (`copy_from`) and cut it (`truncate`).
- `tree` (None: chains): the size of the token trees it drafts.
- `observe_side(logits)` (ignored): the logits of a proposal's side branch (lookahead).
- `observe_forward(rows, seconds)` (ignored): what the target's forward that scored the proposal
  cost (`auto` prices its next steps by it).

A drafter wrapped around another (a prediction, a grammar) subclasses `Wrapper`, which takes every
capability above from the drafter inside but the ones its own code decides (`Wrapper.OWN`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from verispec.core.errors import VerispecError
from verispec.core.tree import TreeSettings
from verispec.core.types import Proposal, SamplingParams

if TYPE_CHECKING:
    from verispec.model.cached_model import CachedModel


@dataclass(frozen=True)
class DraftRequest:
    """Everything a drafter may look at when proposing."""

    tokens: torch.Tensor  # [context_len] int64: prompt + every committed token
    k: int  # most tokens to propose: the policy's draft length within `room` (0: propose nothing)
    sampling: SamplingParams
    generator: torch.Generator | None
    # The target's final hidden state at every committed position but the last, for drafters
    # that declare `needs_hidden` (EAGLE, Medusa), followed by its residual state after the first
    # L layers for each L in the drafter's `hidden_layers` (if it has any); None for the others.
    target_hidden: torch.Tensor | None = None  # [context_len - 1, hidden * (1 + len(layers))]
    # Most draft tokens this step may hold at all: the sequence's token budget and the batch's cap.
    # Only drafters that declare `uses_room` (a prediction, a grammar's forced tokens) go past k.
    room: int | None = None
    batch: int = 1  # sequences sharing this step's target pass (the verify cost grows with them)
    # The sequence has a seed: a drafter decides by the tokens alone, never by wall time, so the
    # seed pins a sampled output (a choice that followed the machine's load would move it).
    seeded: bool = False

    @property
    def limit(self) -> int:
        """`room`, or k where no room was given."""
        return self.k if self.room is None else self.room


class Drafter:
    """A drafter owns its state (a KV cache, say) and keeps it in step with the committed text.

    `commit` follows every `propose` (also an empty one): the target kept that many of the
    proposed tokens. Capabilities are declared as class attributes (the table in the module
    docstring), overridden where a drafter has them.
    """

    needs_hidden: bool = False
    hidden_layers: tuple[int, ...] = ()
    adopts_prefill: bool = False
    uses_room: bool = False
    batches: bool = False
    forks: bool = False
    tree: TreeSettings | None = None

    def reset(self) -> None:
        """Forget everything: a new sequence starts."""

    def propose(self, request: DraftRequest) -> Proposal:
        """Up to request.k draft tokens continuing request.tokens, with their q (or None)."""
        raise NotImplementedError

    def commit(self, num_accepted: int) -> None:
        """The target kept the first num_accepted tokens of the last proposal; rewind the rest."""

    def adopt_prefill(self, target: CachedModel) -> None:
        """The target has cached the prompt (all but its last token); a drafter that
        `adopts_prefill` may copy those keys and values instead of prefilling them itself."""

    def observe_side(self, logits: torch.Tensor) -> None:
        """The target's logits [m, vocab] for the last proposal's side branch (Proposal.side)."""

    def observe_forward(self, rows: int, seconds: float) -> None:
        """The target's forward that scored the last proposal: `rows` rows (those of every
        sequence sharing the pass), in `seconds`; it comes before `commit`."""

    def copy_from(self, other: Drafter) -> None:
        """Take another drafter's state (beam search, where a beam splits); `forks` drafters."""
        raise VerispecError(f"{type(self).__name__} cannot copy another drafter's state")

    def truncate(self, length: int) -> None:
        """Keep at most the first `length` context tokens of own state (beam search)."""
        raise VerispecError(f"{type(self).__name__} cannot cut its state")

    def describe(self) -> str | None:
        """What drafts, in a few words, for reports (None: the method's name says it)."""
        return None

    @property
    def nbytes(self) -> int | None:
        """Bytes of the drafter's own weights (None: it has none)."""
        return None

    @staticmethod
    def propose_batch(drafters: list[Drafter], requests: list[DraftRequest]) -> list[Proposal]:
        """Several sequences' proposals; a drafter that `batches` drafts them in one pass."""
        return [drafter.propose(request) for drafter, request in zip(drafters, requests)]


CAPABILITIES = tuple(Drafter.__annotations__)  # every capability Drafter declares (the table above)


class Wrapper(Drafter):
    """A drafter around another one (`drafter`; None: none) that drafts some steps itself (a
    prediction, a grammar's forced tokens) and hands the others on.

    One rule for capabilities: a wrapper has every capability of the drafter inside (CAPABILITIES:
    a capability declared on Drafter later is forwarded too), but those in OWN, which describe the
    wrapper's own code: it is asked every step (`uses_room`), drafts one sequence at a time
    (`batches`) and cannot fork its state for beam search (`forks`).
    """

    OWN = frozenset({"uses_room", "batches", "forks"})
    uses_room = True

    def __init__(self, drafter: Drafter | None) -> None:
        self.drafter = drafter
        if drafter is not None:
            for name in CAPABILITIES:
                if name not in self.OWN:
                    setattr(self, name, getattr(drafter, name))

    def reset(self) -> None:
        if self.drafter is not None:
            self.drafter.reset()

    def adopt_prefill(self, target: CachedModel) -> None:
        self.drafter.adopt_prefill(target)

    def observe_side(self, logits: torch.Tensor) -> None:
        self.drafter.observe_side(logits)

    def observe_forward(self, rows: int, seconds: float) -> None:
        if self.drafter is not None:
            self.drafter.observe_forward(rows, seconds)
