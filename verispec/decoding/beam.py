"""Speculative beam search: Hugging Face's beam search, with several steps per target forward.

`BeamSearch` is Hugging Face `generate(num_beams=B)`'s bookkeeping for one prompt (transformers
5.23.0, `GenerationMixin._beam_search` and its helpers), the same tensor operations in the same
order: the top (1 + number of EOS ids, at least 2) * B continuations of all running beams by summed
log-probability, the best B of those that did not just end continue, those among the first B
that end (EOS or max_new_tokens) compete for the B finished slots with score
sum / generated_length ** length_penalty, and the early-stop heuristic (`early_stopping` False,
True or "never") ends the search. Ties fall as torch.topk orders them, as in Hugging Face.

`BeamDecoder` runs it speculatively. Every running beam drafts a continuation of its own (prompt
lookup, or a model drafter such as the target's own weights in int4, each beam with its own
drafter state); one target pass (verispec.model.cached_model.forward_rows) scores every beam's block
[last token, draft...] of every prompt. The search then advances step after step on those logits
for as long as each beam it keeps follows its origin's draft: a beam whose tokens since the block
began are a prefix of the draft its origin beam made has its next log-probs in the scored block.
The first step is always covered (row 0 of every block); the block ends at the first step that
keeps a beam off the drafts. Each step sees exactly the log-probs a one-step-per-forward search
would, so the beams, finished sequences and scores are those of plain beam search.

Exactness is up to float rounding: a block of several tokens can round differently from one-token
forwards (and verispec's forward from Hugging Face's), which can flip a choice at a near-tie.
Tested identical to Hugging Face in float32 on CPU (tests/test_beam.py).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from verispec.core.errors import VerispecError
from verispec.core.stopping import StoppingRules
from verispec.core.types import SamplingParams
from verispec.decoding.engine import SpeculativeEngine
from verispec.drafters.base import Drafter, DraftRequest
from verispec.model.cached_model import CachedModel, forward_rows

if TYPE_CHECKING:
    from transformers import PreTrainedModel

NEG = -1.0e9  # Hugging Face's "impossible" score offset


@dataclass(frozen=True)
class BeamSettings:
    """Beam search as Hugging Face defines it: num_beams, length_penalty (finished scores are
    sum of log-probs / generated length ** length_penalty), early_stopping (False: stop when no
    running beam can beat the worst finished one at the current length; True: stop as soon as B
    sequences finished; "never": the heuristic at max length when length_penalty > 0), and how
    many of the best finished sequences to return."""

    num_beams: int
    length_penalty: float = 1.0
    early_stopping: bool | str = False
    num_return_sequences: int = 1

    def __post_init__(self) -> None:
        if isinstance(self.num_beams, bool) or not isinstance(self.num_beams, int) or self.num_beams < 1:
            raise VerispecError(f"num_beams must be a positive integer, got {self.num_beams!r}")
        if not isinstance(self.length_penalty, (int, float)) or isinstance(self.length_penalty, bool):
            raise VerispecError(f"length_penalty must be a number, got {self.length_penalty!r}")
        if self.early_stopping not in (True, False, "never") or not isinstance(self.early_stopping,
                                                                               (bool, str)):
            raise VerispecError(f"early_stopping must be True, False or 'never', got {self.early_stopping!r}")
        count = self.num_return_sequences
        if isinstance(count, bool) or not isinstance(count, int) or not 1 <= count <= self.num_beams:
            raise VerispecError(f"num_return_sequences must be between 1 and num_beams "
                                f"({self.num_beams}), got {count!r}")


class BeamSearch:
    """One prompt's beam search state, advanced one step at a time by `advance` (pure tensors).

    running: [B, max_new_tokens] the running beams' generated tokens (first `length` valid);
    running_scores: [B] their summed log-probs, best first; finished / finished_scores /
    finished_lengths / finished_flags: [B, max_new_tokens] / [B] / [B] / [B], Hugging Face's B
    finished slots (best first; an empty slot scores NEG).
    """

    def __init__(self, settings: BeamSettings, max_new_tokens: int, eos_token_ids: frozenset[int],
                 device: torch.device) -> None:
        b = settings.num_beams
        self.settings = settings
        self.max_new_tokens = max_new_tokens
        self.eos = torch.tensor(sorted(eos_token_ids), dtype=torch.int64, device=device)
        self.keep = max(2, 1 + len(eos_token_ids)) * b  # candidates kept per step
        self.first_b = torch.arange(self.keep, device=device) < b  # [keep]
        self.running = torch.zeros(b, max_new_tokens, dtype=torch.int64, device=device)
        self.running_scores = torch.full((b,), NEG, device=device)
        self.running_scores[0] = 0.0  # the B copies of the prompt count once
        self.finished = torch.zeros_like(self.running)
        self.finished_scores = torch.full((b,), NEG, device=device)
        self.finished_lengths = torch.zeros(b, dtype=torch.int64, device=device)
        self.finished_flags = torch.zeros(b, dtype=torch.bool, device=device)
        self.improvable = True  # Hugging Face's is_early_stop_heuristic_unsatisfied
        self.length = 0  # tokens generated by every running beam
        self.done = False

    def advance(self, log_probs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One step from the running beams' next-token log-probs [B, vocab] (float32,
        log_softmax of the logits). Returns each new running beam's parent [B] and token [B]."""
        s = self.settings
        b, vocab = log_probs.shape
        cur = self.length
        scores = (log_probs + self.running_scores[:, None]).reshape(1, -1)  # [1, B * vocab]
        top_scores, top_index = torch.topk(scores, k=self.keep)
        top_scores, top_index = top_scores[0], top_index[0]  # [keep]
        parents, tokens = top_index // vocab, top_index % vocab
        sequences = self.running[parents]  # [keep, max_new_tokens]
        sequences[:, cur] = tokens
        ended = torch.isin(tokens, self.eos) | (cur + 1 >= self.max_new_tokens)  # [keep]

        # The best B candidates that did not just end run on (Hugging Face's step e).
        running_scores = top_scores + ended.to(torch.float32) * NEG
        chosen = torch.topk(running_scores, k=b)[1]
        # Candidates among the first B that ended compete for the finished slots (step f).
        just_finished = ended & self.first_b
        finished = top_scores / ((cur + 1) ** s.length_penalty)
        full = bool(self.finished_flags.all()) and s.early_stopping is True
        finished = finished + float(full) * NEG
        finished = finished + float(not self.improvable) * NEG
        finished = finished + (~just_finished) * NEG
        merged_scores = torch.cat([self.finished_scores, finished])
        best = torch.topk(merged_scores, k=b)[1]
        self.finished = torch.cat([self.finished, sequences])[best]
        self.finished_scores = merged_scores[best]
        self.finished_lengths = torch.cat([self.finished_lengths,
                                           torch.full_like(tokens, cur + 1)])[best]
        self.finished_flags = torch.cat([self.finished_flags, just_finished])[best]

        self.running = sequences[chosen]
        self.running_scores = running_scores[chosen]
        self.length = cur + 1
        # The early-stop heuristic (step g).
        if s.early_stopping == "never" and s.length_penalty > 0.0:
            best_length = self.max_new_tokens
        else:
            best_length = self.length
        best_possible = self.running_scores[:1] / (best_length ** s.length_penalty)
        worst_finished = torch.where(self.finished_flags, torch.min(self.finished_scores), NEG)
        self.improvable = self.improvable and bool(torch.any(best_possible > worst_finished))
        self.done = (not self.improvable or (bool(self.finished_flags.all()) and s.early_stopping is True)
                     or bool(ended.all()))
        return parents[chosen], tokens[chosen]

    def best(self) -> list[tuple[list[int], float]]:
        """The num_return_sequences best finished sequences (new tokens) with their scores."""
        count = self.settings.num_return_sequences
        return [(self.finished[i, : int(self.finished_lengths[i])].tolist(),
                 float(self.finished_scores[i])) for i in range(count)]


@dataclass
class BeamStats:
    """What one prompt's search cost: search steps, target forwards (batched with the other
    prompts'), draft tokens scored, and seconds (the whole batch's)."""

    steps: int = 0
    target_forwards: int = 0
    drafted: int = 0
    multi_step_forwards: int = 0  # forwards that advanced the search more than one step
    seconds: float = 0.0

    @property
    def steps_per_forward(self) -> float:
        return self.steps / self.target_forwards if self.target_forwards else 0.0


@dataclass
class BeamResult:
    """One returned sequence: new token ids, its beam score (Hugging Face's sequences_scores),
    the text when a tokenizer is known, and its prompt's search statistics."""

    prompt_ids: list[int]
    token_ids: list[int]
    score: float
    stats: BeamStats = field(default_factory=BeamStats)
    text: str | None = None


Slot = tuple[CachedModel, Drafter | None]  # one running beam's target cache and drafter


def check_drafter(drafter: Drafter | None) -> None:
    """Beam search forks drafter state when beams split: drafters that declare `forks` (prompt
    lookup, model drafters) drafting chains; anything else is refused."""
    if drafter is None or (drafter.forks and drafter.tree is None):
        return
    raise VerispecError(f"beam search drafts with prompt lookup or a model drafter (pld, self-*, "
                        f"draft, early-exit) drafting chains; {type(drafter).__name__}"
                        f"{' with a tree' if drafter.forks else ''} is not supported")


class _Prompt:
    """One prompt's search: its state, its beams' slots and the drafts of the current block."""

    def __init__(self, prompt_ids: list[int], search: BeamSearch, slots: list[Slot]) -> None:
        device = slots[0][0].device
        self.prompt = torch.tensor(prompt_ids, dtype=torch.int64, device=device)
        self.prompt_ids = prompt_ids
        self.search = search
        self.slots = slots
        self.stats = BeamStats()
        self.drafts: list[torch.Tensor] = []

    def context(self, beam: int) -> torch.Tensor:
        """Beam `beam`'s tokens: prompt + generated. [prompt + length]"""
        return torch.cat([self.prompt, self.search.running[beam, : self.search.length]])


class BeamDecoder:
    """Beam search over `target`, speculating with `drafter` and more like it made by `spawn`
    (one per running beam) drafting k tokens per beam; no drafter or k = 0: one step per
    forward, verispec's plain beam search."""

    def __init__(self, target: PreTrainedModel, drafter: Drafter | None = None,
                 spawn: Callable[[], Drafter] | None = None, k: int = 0) -> None:
        if drafter is not None and k > 0:
            check_drafter(drafter)
            if spawn is None:
                raise VerispecError("beam search needs a drafter per beam: build the engine with "
                                    "verispec.methods.build_engine")
        else:
            drafter, spawn, k = None, None, 0
        self.model = target
        self.spawn = spawn
        self.k = k
        self._pool: list[Slot] = [(CachedModel(target), drafter)]

    @classmethod
    def of(cls, engine: SpeculativeEngine) -> BeamDecoder:
        """Beam search with the engine's target and drafter, drafting the policy's first k."""
        spec = engine.speculation
        k = 0 if spec.drafter is None else spec.policy.next_k()
        return cls(engine.model, spec.drafter, spec.spawn, k)

    def _slot(self) -> Slot:
        if self._pool:
            return self._pool.pop()
        return CachedModel(self.model), None if self.spawn is None else self.spawn()

    def _release(self, slots: list[Slot]) -> None:
        self._pool.extend(slots)

    def _start(self, prompt_ids: list[int], stopping: StoppingRules, settings: BeamSettings) -> _Prompt:
        """B slots holding the prompt but its last token (prefilled once, copied)."""
        slots = [self._slot() for _ in range(settings.num_beams)]
        first = slots[0][0]
        first.reset()
        if len(prompt_ids) > 1:
            first.prefill(torch.tensor(prompt_ids[:-1], dtype=torch.int64, device=first.device))
        for cache, drafter in slots:
            if cache is not first:
                cache.copy_from(first)
            if drafter is not None:
                drafter.reset()
                if drafter.adopts_prefill:
                    drafter.adopt_prefill(first)
        search = BeamSearch(settings, stopping.max_new_tokens, stopping.eos_token_ids, first.device)
        return _Prompt(prompt_ids, search, slots)

    def _draft(self, prompts: list[_Prompt]) -> None:
        """Each running beam's draft (k tokens at most, none past the budget); at the first step
        only beam 0 drafts (the others are copies of it that count for nothing)."""
        requests: list[tuple[_Prompt, int, DraftRequest]] = []
        for p in prompts:
            p.drafts = [p.prompt[:0]] * len(p.slots)
            k = min(self.k, p.search.max_new_tokens - p.search.length - 1)
            if self.spawn is None or k <= 0:
                continue
            for beam in range(1 if p.search.length == 0 else len(p.slots)):
                requests.append((p, beam, DraftRequest(p.context(beam), k, SamplingParams(), None)))
        if not requests:
            return
        drafters = [p.slots[beam][1] for p, beam, _ in requests]
        proposals = type(drafters[0]).propose_batch(drafters, [r for _, _, r in requests])
        for (p, beam, _), proposal in zip(requests, proposals):
            p.drafts[beam] = proposal.tokens
            p.stats.drafted += len(proposal)

    def _settle(self, p: _Prompt, logits: list[torch.Tensor], seconds: float) -> None:
        """Advance p's search on its beams' block logits (each [1 + draft, vocab]) for as long as
        its beams stay on the drafts, then give each new beam its origin's cache and drafter."""
        search = p.search
        log_probs = [torch.log_softmax(rows.float(), dim=-1) for rows in logits]
        start = search.length
        origin = torch.arange(len(p.slots))
        steps = 0
        while True:
            rows = torch.stack([log_probs[o][steps] for o in origin.tolist()])
            parents, tokens = search.advance(rows)
            origin = origin[parents.cpu()]
            steps += 1
            if search.done or not all(
                    steps <= len(p.drafts[o]) and int(p.drafts[o][steps - 1]) == int(token)
                    for o, token in zip(origin.tolist(), tokens.tolist())):
                break
        p.stats.steps += steps
        p.stats.target_forwards += 1
        p.stats.multi_step_forwards += steps > 1
        p.stats.seconds += seconds
        if search.done:
            return
        cached = p.slots[0][0].length - len(logits[0])  # before the block: context - 1
        context = len(p.prompt_ids) + start
        new: list[Slot | None] = [None] * len(p.slots)
        taken: set[int] = set()
        for j, o in enumerate(origin.tolist()):
            if o not in taken:
                new[j], _ = p.slots[o], taken.add(o)
        for j, o in enumerate(origin.tolist()):
            if new[j] is None:
                new[j] = self._slot()
                new[j][0].copy_from(p.slots[o][0])
                if new[j][1] is not None:
                    new[j][1].copy_from(p.slots[o][1])
        self._release([slot for o, slot in enumerate(p.slots) if o not in taken])
        for cache, drafter in new:
            cache.rewind(cached + steps)  # the block's rows up to the last step's input
            if drafter is not None:  # the context and the drafts all beams share
                drafter.truncate(context + steps - 1)
        p.slots = new

    def generate(self, prompts: list[list[int]], stopping: StoppingRules,
                 settings: BeamSettings) -> list[list[BeamResult]]:
        """Beam search for every prompt together (one target pass per block for all beams of all
        prompts); per prompt, its num_return_sequences best sequences, best first."""
        active: list[_Prompt] = []
        try:
            for prompt_ids in prompts:
                active.append(self._start(prompt_ids, stopping, settings))
            all_prompts = list(active)
            while active:
                self._draft(active)
                slots = [slot for p in active for slot in p.slots]
                blocks = [torch.cat([p.context(beam)[-1:], p.drafts[beam]])
                          for p in active for beam in range(len(p.slots))]
                started = time.perf_counter()
                outputs = forward_rows([cache for cache, _ in slots], blocks, [None] * len(blocks))
                seconds = time.perf_counter() - started
                at = 0
                for p in active:
                    count = len(p.slots)
                    self._settle(p, [logits for logits, _ in outputs[at: at + count]], seconds)
                    at += count
                for p in [p for p in active if p.search.done]:
                    self._release(p.slots)
                    p.slots = []
                active = [p for p in active if not p.search.done]
        except BaseException:
            for p in active:
                self._release(p.slots)
            raise
        return [[BeamResult(p.prompt_ids, tokens, score, p.stats) for tokens, score in p.search.best()]
                for p in all_prompts]
