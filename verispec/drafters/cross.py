"""A draft model with another tokenizer than the target's: its text carried into the target's
tokens (docs/cross-tokenizer.md).

The draft model reads the committed text in its own tokens and drafts in them; what the target
verifies is always target tokens, so nothing about the target's verification changes:

- string match (greedy decoding, and sampling with `sampled="string"`): the draft's most likely
  tokens, their text re-tokenized by the target's tokenizer in the context of the last committed
  tokens; the target tokens whose text ends before the draft's last token are proposed (the last
  one may still grow: "hel" drafted, "hello" the target's token). Under greedy any draft is safe
  (the target keeps what its own argmax agrees with); under sampling a guess is verified with a
  one-hot q, which keeps the target's law for any guess made before the verifier draws.
- token-level intersection (sampling, the default there): the draft samples only among the
  tokens whose text is one target token's (verispec.drafters.vocab.Bridge), from its warped
  distribution renormalized over them, and reports that q over the target's ids; the standard
  rule is then exact (Timor et al. 2025, TLI).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from verispec.core.argmax import argmax
from verispec.core.errors import VerispecError
from verispec.core.sampling import sample, warp_probs
from verispec.core.types import Proposal
from verispec.drafters.base import Drafter, DraftRequest
from verispec.drafters.vocab import Bridge, valid_prefix
from verispec.model.cached_model import CachedModel, forward_tails
from verispec.model.loading import context_length

if TYPE_CHECKING:
    from transformers import PreTrainedModel

SAMPLED = ("tli", "string")  # how drafts are made under sampling
WINDOW = 8  # committed target tokens re-tokenized with the draft's text (the boundary can merge)
OPEN = 64  # target tokens the drafter re-reads in its own tokens before it fixes the oldest
MAX_RATIO = 4  # most draft tokens per target token a step may draft (a character-level draft)
SLACK = 1.5  # draft tokens a step may make: this many times k + 1 target tokens' worth


@dataclass
class _Draft:
    """One sequence's draft in progress (one `propose`)."""

    request: DraftRequest
    cap: int  # most draft tokens to make
    logits: torch.Tensor | None = None  # [draft vocab]: the draft's next-token logits
    tokens: list[int] = field(default_factory=list)  # draft ids drafted
    ends: list[int] = field(default_factory=list)  # byte offset in `text` where each ends
    text: bytes = b""  # what the drafted tokens spell
    proposal: list[int] = field(default_factory=list)  # target ids to propose
    probs: list[torch.Tensor] = field(default_factory=list)  # their q [target vocab] (TLI)
    covered: int = 0  # bytes of `text` the proposal spells (string match)
    end: int | None = None  # the target's id for the special token that ended the draft's text


class CrossDrafter(Drafter):
    """Drafts with a causal LM whose tokenizer is not the target's, through a Bridge.

    It keeps its own KV cache over the committed text in its own tokens: each `propose` reads the
    new target tokens as text, re-tokenizes the open end of the context (where the two
    tokenizations may disagree), rewinds its cache to where the tokens still agree and feeds the
    rest. `confidence_threshold` stops a draft where the draft model's probability of its token
    falls below it, as for same-tokenizer drafts; k counts target tokens.
    """

    batches = True

    def __init__(self, model: PreTrainedModel | CachedModel, bridge: Bridge, vocab_size: int,
                 confidence_threshold: float | None = None, sampled: str = "tli") -> None:
        """model: the draft model, or a CachedModel already set up to run it; vocab_size: the
        target's logits width; sampled: "tli" or "string", how drafts are made under sampling
        (string match where the vocabularies share no token)."""
        if confidence_threshold is not None and not 0 <= confidence_threshold <= 1:
            raise VerispecError(f"confidence threshold must be in [0, 1], got {confidence_threshold}")
        if sampled not in SAMPLED:
            raise VerispecError(f"drafting across tokenizers under sampling is one of {', '.join(SAMPLED)}, "
                                f"got {sampled!r}")
        self.lm = model if isinstance(model, CachedModel) else CachedModel(model)
        self.bridge = bridge
        self.vocab_size = vocab_size
        self.confidence_threshold = confidence_threshold
        # Token-level intersection needs tokens in common; without any, string match samples too.
        self.sampled = sampled if bridge.shared_draft.numel() else "string"
        from transformers import PreTrainedModel  # not at the top: transformers takes seconds to import

        self.context = context_length(self.lm.model) if isinstance(self.lm.model, PreTrainedModel) else None
        device = self.lm.device
        self.shared_draft = bridge.shared_draft.to(device)
        self.shared_target = bridge.shared_target.to(device)
        self.reset()

    def reset(self) -> None:
        self.lm.reset()
        self._target: list[int] = []  # the committed target ids read so far
        self._fixed: list[int] = []  # draft ids standing for self._target[: self._open]
        self._open = 0  # where the open end starts: re-read in draft tokens at every step
        self._fed: list[int] = []  # draft ids in the cache
        self._held = b""  # the committed text's last bytes, an incomplete character, unread

    def describe(self) -> str | None:
        sampled = "token-level intersection" if self.sampled == "tli" else "string match"
        return (f"a draft model with its own tokenizer ({len(self.shared_draft)} tokens shared): "
                f"string match under greedy, {sampled} under sampling")

    # -- the committed text in the draft's tokens ------------------------------------------------

    def _read(self, committed: list[int]) -> list[int]:
        """The draft ids for the committed target ids (the open end re-tokenized)."""
        if committed[: len(self._target)] != self._target:  # not a continuation: read afresh
            self.lm.reset()
            self._target, self._fixed, self._open, self._fed = [], [], 0, []
        self._target = committed
        target, draft = self.bridge.target, self.bridge.draft
        start = self._open
        for i in range(self._open, len(committed)):
            if committed[i] in target.specials:  # the text before it is final, in draft tokens too
                self._fixed += draft.ids_for(valid_prefix(target.text(committed[start:i]))[0])
                self._fixed += self.bridge.special_to_draft.get(committed[i], [])
                start = i + 1
        self._open = start
        if len(committed) - start > 2 * OPEN:
            self._fix_oldest(committed, valid_prefix(target.text(committed[start:]))[0])
        spelled = target.text(committed[self._open:])
        text, whole = valid_prefix(spelled)
        self._held = spelled[whole:]
        return self._fixed + draft.ids_for(text)

    def _fix_oldest(self, committed: list[int], text: str) -> None:
        """Move the open end's oldest tokens into the fixed part, at a place where a target token
        and a draft token both begin, so that the text re-read each step stays short."""
        exact = self.bridge.draft.encode(text)
        if exact is None:
            return
        ids, ends = exact
        starts = {end: n for n, end in enumerate(ends, 1)}  # byte offset -> draft tokens before it
        offset = 0
        for i in range(self._open, len(committed) - OPEN):
            offset += len(self.bridge.target.pieces[committed[i]] or b"")
            if offset in starts and len(committed) - (i + 1) <= 2 * OPEN:
                self._fixed += ids[: starts[offset]]
                self._open = i + 1
                return

    def _feed(self, wanted: list[int]) -> torch.Tensor:
        """Rewind the cache to where it agrees with `wanted`, keeping at least one token to feed
        (the next-token logits come from it); the ids to feed [n]."""
        same = 0
        for have, want in zip(self._fed, wanted):
            if have != want:
                break
            same += 1
        same = min(same, len(wanted) - 1)
        self.lm.rewind(same)
        self._fed = wanted[:same]
        return torch.tensor(wanted[same:], dtype=torch.int64, device=self.lm.device)

    # -- drafting -------------------------------------------------------------------------------

    def propose(self, request: DraftRequest) -> Proposal:
        return self.propose_batch([self], [request])[0]

    @staticmethod
    def propose_batch(drafters: list[CrossDrafter], requests: list[DraftRequest]) -> list[Proposal]:
        """Every sequence's draft, one draft-model forward per drafting position for all of them
        (one pass where the drafters are lean over shared weights)."""
        drafts: dict[int, _Draft] = {}
        blocks: dict[int, torch.Tensor] = {}  # what each drafting sequence feeds next
        for i, (drafter, request) in enumerate(zip(drafters, requests)):
            wanted = drafter._read(request.tokens.tolist())
            # Draft tokens per target token in this context (a character-level draft needs more),
            # with room for longer words than the context's and the draft token after the last.
            ratio = min(MAX_RATIO, max(1.0, len(wanted) / request.tokens.shape[0]))
            cap = math.ceil(SLACK * ratio * (request.k + 1))
            if (request.k < 1 or not wanted
                    or (drafter.context is not None and len(wanted) + cap > drafter.context)):
                continue  # nothing to draft from, or no room left in the draft model's context
            drafts[i] = _Draft(request, cap)
            blocks[i] = drafter._feed(wanted)
        while blocks:
            order = list(blocks)
            outputs = forward_tails([drafters[i].lm for i in order], [blocks[i] for i in order],
                                    [1] * len(order))
            fed, blocks = blocks, {}
            for i, logits in zip(order, outputs):
                drafters[i]._fed += fed[i].tolist()
                token = drafters[i]._step(drafts[i], logits[0])
                if token is not None:
                    blocks[i] = torch.tensor([token], dtype=torch.int64, device=drafters[i].lm.device)
        return [drafter._proposal(drafts.get(i), request)
                for i, (drafter, request) in enumerate(zip(drafters, requests))]

    def _step(self, draft: _Draft, logits: torch.Tensor) -> int | None:
        """Take the draft model's next token from logits [draft vocab]; the draft id to feed
        next, or None where this draft is done."""
        if draft.request.sampling.greedy or self.sampled == "string":
            return self._step_string(draft, logits)
        return self._step_shared(draft, logits)

    def _unsure(self, probs: torch.Tensor, index: int) -> bool:
        """Whether the draft model's probability of its choice (probs [n] over what it chose
        from) is below the confidence threshold; one host read, only when a threshold is set."""
        return self.confidence_threshold is not None and float(probs[index]) < self.confidence_threshold

    def _step_string(self, draft: _Draft, logits: torch.Tensor) -> int | None:
        """String match: the draft's most likely token; its text carried into target tokens.
        The draft ends where it disagrees with the committed text's last, incomplete character;
        where the target's tokenizer cannot spell its text yet (a word it lacks, unfinished), the
        tokens proposed so far stand."""
        token = int(argmax(logits))
        draft.tokens.append(token)
        pieces = self.bridge.draft.pieces
        piece = pieces[token] if token < len(pieces) else None
        if piece is None:  # a special token: the draft's text ends; an end of text the target's
            draft.end = self.bridge.special_to_target.get(token)
            carried = self._carry(draft, final=draft.end is not None)
            if carried is not None:
                draft.proposal, draft.covered = carried
            return None
        draft.text += piece
        draft.ends.append(len(draft.text))
        held = self._held[: len(draft.text)]
        if draft.text[: len(held)] != held:
            return None
        carried = self._carry(draft, final=False)
        if carried is not None:
            draft.proposal, draft.covered = carried
        if (len(draft.proposal) >= draft.request.k or len(draft.tokens) >= draft.cap
                or self._unsure(logits.softmax(-1), token)):
            return None
        return token

    def _carry(self, draft: _Draft, final: bool) -> tuple[list[int], int] | None:
        """The target tokens for the drafted text that are safe to propose, and the bytes of the
        drafted text they account for; None where the text cannot go into target tokens.

        The text is tokenized after the last few committed tokens, so that a merge across the
        boundary shows: those tokens must come back unchanged, else the text is tokenized alone.
        A target token is kept where it ends before the draft's last token begins ("hel" drafted
        may be "hello" in the target's tokens), anywhere where the draft's text is `final` (it
        drafted an end of text). Where the committed text ends inside a character, the draft
        (which read the text before that character) spells the character's start again first."""
        held = self._held
        if len(draft.text) <= len(held) or draft.text[: len(held)] != held:
            return None
        new = draft.text[len(held):]
        target = self.bridge.target
        committed = self._target
        start = max(self._open, len(committed) - WINDOW)
        window = committed[start:]
        spaced = [n for n, t in enumerate(window) if (target.pieces[t] or b"x")[:1] in (b" ", b"\n")]
        window = window[spaced[-1]:] if spaced else window
        context = target.text(window)
        while window and context[:1] and context[0] & 0xC0 == 0x80:  # starts inside a character
            context = context[len(target.pieces[window[0]] or b""):]
            window = window[1:]
        text, _ = valid_prefix(context + new)
        found = target.encode(text)
        if found is not None and found[0][: len(window)] == window:
            ids = found[0][len(window):]
            ends = [end - len(context) + len(held) for end in found[1][len(window):]]
        elif held:
            return None  # the character cut inside is not finished after the committed tokens
        else:
            found = target.encode(valid_prefix(new)[0])
            if found is None:
                return None
            ids, ends = found
        limit = len(draft.text) if final else (draft.ends[-2] if len(draft.ends) > 1 else 0)
        kept = 0
        while kept < len(ids) and ends[kept] <= limit:
            kept += 1
        return ids[:kept], ends[kept - 1] if kept else len(held)

    def _step_shared(self, draft: _Draft, logits: torch.Tensor) -> int | None:
        """Token-level intersection: a draw from the draft's warped law over the shared tokens,
        renormalized; its q is reported over the target's ids."""
        request = draft.request
        shared = logits[self.shared_draft]  # [m]
        q_shared = warp_probs(shared, request.sampling)  # [m]
        index = int(sample(q_shared, request.generator))
        token, target_token = int(self.shared_draft[index]), int(self.shared_target[index])
        q = torch.zeros(self.vocab_size, device=q_shared.device).index_copy_(
            0, self.shared_target, q_shared)  # [target vocab]
        draft.tokens.append(token)
        draft.proposal.append(target_token)
        draft.probs.append(q)
        if (len(draft.proposal) >= request.k or target_token in self.bridge.target_eos
                or self._unsure(shared.softmax(-1), index)):
            return None
        return token

    def _proposal(self, draft: _Draft | None, request: DraftRequest) -> Proposal:
        """The finished draft as a Proposal of at most k target tokens, with how many draft
        tokens it took and how many of them were lost at the tokenizer boundary."""
        if draft is None:
            return Proposal(request.tokens[:0])
        device = request.tokens.device
        if draft.probs:  # token-level intersection: one target token per draft token
            return Proposal(torch.tensor(draft.proposal, device=device), torch.stack(draft.probs),
                            foreign_tokens=len(draft.tokens))
        tokens = draft.proposal[: request.k]
        covered = draft.covered if len(tokens) == len(draft.proposal) else self._spelled(tokens)
        ending = (draft.end is not None and len(tokens) == len(draft.proposal) < request.k
                  and covered == len(draft.text))  # the end of text comes after all its text
        if ending:
            tokens = tokens + [draft.end]
        lost = sum(1 for end in draft.ends if end > covered)
        lost += len(draft.tokens) - len(draft.ends) - ending  # specials not carried over
        return Proposal(torch.tensor(tokens, dtype=torch.int64, device=device),
                        foreign_tokens=len(draft.tokens), boundary_lost=lost)

    def _spelled(self, tokens: list[int]) -> int:
        """Bytes the target tokens spell."""
        return len(self.bridge.target.text(tokens))
