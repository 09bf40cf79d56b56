"""The decode loop: propose -> verify -> commit -> adapt the draft length, for one sequence or a
batch of them.

The engine owns the target's KV caches (one per sequence) and rewinds each once per step, after
verification. Each drafter owns and rewinds its own state; verifiers are pure. Invariant at the
start of a step: a sequence's target cache holds every committed token but the last, which is fed
together with the draft, so one forward of 1 + k tokens scores all k drafts and yields the token
after them.

A batch steps every sequence together: each drafts on its own (its own drafter, k and state), one
target pass verifies every sequence's block (verispec.target.cached_model.forward_rows: the weights are
read once for all rows), and each accepts its own number of tokens and rewinds its own cache.
Sequences join (`add`) and leave (finished, or `cancel`) between steps: continuous batching.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from verispec.core.errors import VerispecError
from verispec.core.grammar import Constraint, apply_masks
from verispec.core.policies import ConstantK, DraftLengthPolicy, LoadCap
from verispec.core.stopping import StoppingRules
from verispec.core.tree import check_parents
from verispec.core.types import (
    DraftTree,
    Fate,
    GenerationResult,
    Proposal,
    SamplingParams,
    Step,
    TokenLogprob,
)
from verispec.drafters.base import Drafter, DraftRequest
from verispec.target.cached_model import CachedModel, forward_rows
from verispec.verifiers import verifier_for


def context_length(model: PreTrainedModel) -> int:
    """The longest sequence the model's positions allow."""
    config = model.config.get_text_config(decoder=True)
    return int(getattr(config, "max_position_embeddings", None) or 2**31)


@dataclass(frozen=True, eq=False)
class Speculation:
    """How a sequence speculates: a drafter like `drafter` (None: plain decoding), more made by
    `spawn` for other sequences, each sequence starting from a copy of `policy`; the acceptance
    rule ("exact", or "typical": LOSSY under sampling). Sequences of a batch may each speculate
    their own way (a server's requests name their methods): they still share target passes."""

    drafter: Drafter | None = None
    policy: DraftLengthPolicy = ConstantK(0)
    acceptance: str = "exact"
    spawn: Callable[[], Drafter] | None = None


@dataclass(frozen=True)
class RowFailure:
    """A sequence whose own part of a step raised (its drafter, its draft's checks, its
    verification): it has left the batch, and the other sequences' steps went on unchanged."""

    error: Exception


class _Row:
    """One sequence being generated: its target cache, drafter, policy, randomness and tokens."""

    def __init__(self, speculation: Speculation, target: CachedModel, drafter: Drafter | None,
                 hidden_size: int, prompt_ids: list[int], stopping: StoppingRules,
                 sampling: SamplingParams, seed: int | None, prediction: Drafter | None = None,
                 logprobs: int | None = None, constraint: Constraint | None = None) -> None:
        device = target.device
        self.speculation = speculation
        self.target, self.drafter = target, drafter
        self.policy = copy.deepcopy(speculation.policy)
        self.stopping, self.sampling = stopping, sampling
        self.generator = torch.Generator(device=device)
        if seed is None:
            self.generator.seed()
        else:
            self.generator.manual_seed(seed % 2**64)  # as torch reads seeds < 0; seed + i may pass 2**64
        self.logprobs = logprobs  # None: none reported; else how many top alternatives per token
        self.verifier = verifier_for(sampling, speculation.acceptance)
        tokens = torch.tensor(prompt_ids, dtype=torch.int64, device=device)
        self.buffer = torch.cat([tokens, tokens.new_zeros(stopping.max_new_tokens)])  # [prompt + new]
        self.length = len(prompt_ids)
        self.generated: list[int] = []
        self.layers = tuple(getattr(drafter, "hidden_layers", ()))  # intermediate states wanted
        # The target's hidden state per committed position, for drafters that read it.
        self.hidden = None
        if getattr(drafter, "needs_hidden", False):
            self.hidden = torch.empty(self.buffer.shape[0], hidden_size * (1 + len(self.layers)),
                                      device=device, dtype=target.model.dtype)  # [prompt + new, .]
        self.proposal = Proposal(self.buffer[:0])
        self.draft_seconds = 0.0
        # The caller's predicted output, drafted before the row's own drafter while it has a draft.
        self.predicted = prediction
        self.from_prediction = False  # this step's draft came from the prediction
        # The grammar the output must match (None: unconstrained), and this step's masks of the
        # tokens it allows at the root and after each draft node [1 + k, vocab].
        self.constraint = constraint
        self.masks: torch.Tensor | None = None
        self.forced = False  # this step's draft is the grammar's forced tokens
        self.proposed = False  # this step's drafter proposed something

    def prefill(self, source: _Row | None = None) -> None:
        """Cache the prompt (all of it but the last token), or copy it from `source`, a row with
        the same prompt (samples of one prompt share its prefill)."""
        self.target.reset()
        if self.drafter is not None:
            self.drafter.reset()
        if self.predicted is not None:
            self.predicted.reset()
        if self.constraint is not None:
            self.constraint.reset()
        if self.length == 1:
            return
        if source is None:
            prompt_hidden = self.target.prefill(self.buffer[: self.length - 1], self.layers)
        else:
            self.target.copy_from(source.target)
            prompt_hidden = None if source.hidden is None else source.hidden[: self.length - 1]
        if self.hidden is not None:
            self.hidden[: self.length - 1] = prompt_hidden
        if getattr(self.drafter, "adopts_prefill", False):
            self.drafter.adopt_prefill(self.target)

    def request(self, cap: int | None) -> DraftRequest | None:
        """What to draft this step (None: nothing): the policy's k, within the budget and the
        batch's cap."""
        remaining = self.stopping.max_new_tokens - len(self.generated)
        # Never draft past the budget: the step always adds one target token after the draft.
        k = min(self.policy.next_k(), remaining - 1) if self.drafter is not None else 0
        if cap is not None:
            k = min(k, cap)
        if k <= 0:
            return None
        hidden = None if self.hidden is None else self.hidden[: self.length - 1]
        return DraftRequest(self.buffer[: self.length], k, self.sampling, self.generator, hidden)

    def force(self, vocab_size: int) -> bool:
        """Take the tokens the grammar forces as this step's draft, if there are any (free to
        propose, always kept: within the budget, not the batch's cap); False: draft otherwise."""
        if self.constraint is None:
            return False
        forced = self.constraint.forced()[: self.stopping.max_new_tokens - len(self.generated) - 1]
        if not forced:
            return False
        self.take(Proposal(torch.tensor(forced, dtype=torch.int64, device=self.buffer.device)), 0.0,
                  vocab_size, forced=True)
        return True

    def predict(self, cap: int | None, vocab_size: int) -> bool:
        """Take the prediction's draft for this step if it has one (as long as it likes, within
        the budget and the batch's cap); False: the row's own drafter drafts."""
        if self.predicted is None:
            return False
        k = self.stopping.max_new_tokens - len(self.generated) - 1
        if cap is not None:
            k = min(k, cap)
        if k <= 0:
            return False
        started = time.perf_counter()
        proposal = self.predicted.propose(DraftRequest(self.buffer[: self.length], k, self.sampling,
                                                       self.generator))
        if not len(proposal):
            return False
        self.take(proposal, time.perf_counter() - started, vocab_size, from_prediction=True)
        return True

    def take(self, proposal: Proposal | None, seconds: float, vocab_size: int,
             from_prediction: bool = False, forced: bool = False) -> None:
        """This step's draft (None: none), and the seconds it took; under a grammar, cut where
        it leaves it (verispec.core.grammar.Constraint.cut)."""
        proposal = Proposal(self.buffer[:0]) if proposal is None else proposal
        if proposal.parents is not None:  # a drafter's tree must be well formed
            check_parents(proposal.parents)
        if len(proposal) and not 0 <= int(proposal.tokens.min()) <= int(proposal.tokens.max()) < vocab_size:
            # Caught here, a bad draft fails its own row, not the batch's shared forward.
            raise VerispecError(f"the drafter proposed a token outside the vocabulary (0..{vocab_size - 1})")
        self.proposed = len(proposal) > 0  # the drafter has state to commit, even if cut to nothing
        if self.constraint is not None:
            proposal, self.masks = self.constraint.cut(proposal)
        self.proposal, self.draft_seconds = proposal, seconds
        self.from_prediction, self.forced = from_prediction, forced

    def block(self) -> torch.Tensor:
        """The tokens the target scores this step: the last committed one, the draft, and the
        draft's side branch if it has one. [1 + k (+ m)]"""
        side = self.proposal.side
        return torch.cat([self.buffer[self.length - 1: self.length], self.proposal.tokens,
                          *(() if side is None else (side.tokens,))])

    def settle(self, logits: torch.Tensor, block_hidden: torch.Tensor, forward_seconds: float) -> Step:
        """Verify the draft against the target's logits [1 + k (+ m side rows), vocab]
        (block_hidden [1 + k (+ m), .]: the states this row's drafter reads), commit, rewind what
        was refused."""
        started = time.perf_counter()
        proposal = self.proposal
        if proposal.side is not None:  # side rows go back to the drafter, never to the verifier
            self.drafter.observe_side(logits[len(proposal) + 1:])
            logits = logits[: len(proposal) + 1]
        if self.masks is not None:  # the constrained target: its own distribution masked
            logits = apply_masks(logits, self.masks.to(logits.device))
        verdict = self.verifier.verify(proposal, logits, self.sampling, self.generator)
        path, accepted = list(verdict.path), verdict.num_accepted
        rows = [0] + [node + 1 for node in path]  # block rows to keep: root + accepted path
        if self.hidden is not None:
            self.hidden[self.length - 1: self.length + accepted] = block_hidden[rows]
        self.target.keep(self.length - 1, rows)
        if self.from_prediction:
            self.predicted.commit(accepted)
        elif self.proposed and not self.forced:
            self.drafter.commit(accepted)
            self.policy.update(proposal.depth, accepted)

        parents = proposal.tree_parents.tolist()
        drafted_tokens = proposal.tokens.tolist()
        end = path[-1] if path else -1
        alternatives = [drafted_tokens[i] for i, parent in enumerate(parents) if parent == end]
        block = [drafted_tokens[i] for i in path] + [verdict.next_token]
        fates = ([Fate.FORCED if self.forced else Fate.ACCEPTED] * accepted
                 + [Fate.RECOVERED if alternatives else Fate.BONUS])
        keep, finished = self.stopping.cut(self.generated, block)
        if self.constraint is not None:  # the grammar complete: nothing more may follow
            complete = self.constraint.commit(block[:keep])
            if complete is not None:
                keep, finished = complete, True
        logprobs = None if self.logprobs is None else token_logprobs(logits[rows[:keep]], block[:keep],
                                                                     self.logprobs)
        self.buffer[self.length: self.length + keep] = torch.tensor(block[:keep])
        self.length += keep
        self.generated += block[:keep]
        shown = None if proposal.parents is None else DraftTree(drafted_tokens, parents, path,
                                                                  proposal.depth)
        verify_seconds = forward_seconds + time.perf_counter() - started
        return Step(block[:keep], fates[:keep], alternatives, len(proposal), accepted,
                    self.draft_seconds, verify_seconds, finished, shown, self.from_prediction,
                    logprobs, self.forced)


class SpeculativeEngine:
    """Generates from `target`, optionally speculating with `drafter` (None: plain decoding).

    One sequence: `steps` / `generate`. Several: `generate_batch`, or `add` sequences and `step`
    them (continuous batching). Every sequence after the first drafts with its own drafter, made
    by `spawn` (verispec.methods.build_engine passes one); drafters and caches are reused once a
    sequence leaves, so memory follows the largest batch, not the number of calls.
    """

    def __init__(self, target: PreTrainedModel, drafter: Drafter | None = None,
                 policy: DraftLengthPolicy | None = None, acceptance: str = "exact",
                 spawn: Callable[[], Drafter] | None = None, load_cap: LoadCap | None = None) -> None:
        """acceptance: "exact" (lossless) or "typical" (Medusa's typical acceptance, LOSSY under
        sampling; see verispec.verifiers.typical). spawn: makes a fresh drafter like `drafter`
        for another sequence of a batch. policy: each sequence starts from a copy of it.
        load_cap: the draft length allowed per sequence at each batch size (default: measured)."""
        verifier_for(SamplingParams(), acceptance)  # reject an unknown rule before any work
        self.model = target
        self.target = CachedModel(target)
        self.drafter = drafter
        self.speculation = Speculation(drafter, policy or ConstantK(0 if drafter is None else 5),
                                       acceptance, spawn)
        self.load_cap = load_cap or LoadCap()
        self.max_length = context_length(target)
        self.vocab_size = target.get_input_embeddings().num_embeddings
        self.hidden_size = int(target.config.get_text_config(decoder=True).hidden_size)
        # Per way of speculating: the target caches and drafters of sequences that have left.
        self._free: dict[Speculation, list[tuple[CachedModel, Drafter | None]]] = {
            self.speculation: [(self.target, drafter)]}
        # The most idle (cache, drafter) pairs kept per way of speculating (absent: no limit); a
        # server bounds the pools of the ways its clients choose (a trained drafter is tens of MB).
        self.pool_limit: dict[Speculation, int] = {}
        self._rows: dict[int, _Row] = {}
        self._next_id = 0

    def check_prompt(self, prompt_ids: list[int], max_new_tokens: int) -> None:
        if not prompt_ids:
            raise VerispecError("the prompt is empty: give at least one token")
        bad = [t for t in prompt_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise VerispecError(
                f"prompt token id {bad[0]} is outside the vocabulary (0..{self.vocab_size - 1})")
        if len(prompt_ids) + max_new_tokens > self.max_length:
            raise VerispecError(
                f"prompt ({len(prompt_ids)} tokens) + max_new_tokens ({max_new_tokens}) exceeds "
                f"the model's context of {self.max_length} tokens")

    # -- rows: a cache and a drafter each, taken from the pool and given back -------------------

    def _open(self, prompt_ids: list[int], stopping: StoppingRules, sampling: SamplingParams,
              seed: int | None, source: _Row | None = None,
              speculation: Speculation | None = None, prediction: Drafter | None = None,
              logprobs: int | None = None, constraint: Constraint | None = None) -> _Row:
        speculation = speculation or self.speculation
        if speculation not in self._free:  # first seen: its own drafter is the first to use
            self._free[speculation] = [(CachedModel(self.model), speculation.drafter)]
        free = self._free[speculation]
        if free:
            target, drafter = free.pop()
        else:
            if speculation.drafter is not None and speculation.spawn is None:
                raise VerispecError("this engine's drafter cannot be copied for a second sequence: "
                                    "build the engine with verispec.methods.build_engine")
            target = CachedModel(self.model)
            drafter = None if speculation.drafter is None else speculation.spawn()
        try:
            row = _Row(speculation, target, drafter, self.hidden_size, prompt_ids, stopping, sampling,
                       seed, prediction, logprobs, constraint)
            row.prefill(source)
        except BaseException:  # a bad setting or a failed prefill: the cache and drafter go back
            free.append((target, drafter))
            raise
        return row

    def _close(self, row: _Row) -> None:
        """The row's cache and drafter go back to the pool, emptied: an idle one holds no KV."""
        row.target.reset()
        if row.drafter is not None:
            row.drafter.reset()
        free = self._free[row.speculation]
        if len(free) < self.pool_limit.get(row.speculation, len(free) + 1):
            free.append((row.target, row.drafter))

    def forget(self, speculation: Speculation) -> bool:
        """Drop the pooled caches and drafters of a way of speculating (a server keeps a bounded
        number of them); False, dropping nothing, while a sequence in the batch uses it."""
        if any(row.speculation is speculation for row in self._rows.values()):
            return False
        if speculation is not self.speculation:
            self._free.pop(speculation, None)
            self.pool_limit.pop(speculation, None)
        return True

    def _step(self, rows: list[_Row]) -> list[Step | RowFailure]:
        """One draft-verify-commit cycle for every row, with one target pass for all of them.
        A row whose own drafting or settling raises gets a RowFailure and the others go on; only
        the shared forward failing fails them all (it raises)."""
        failed = self._draft(rows, self.load_cap.k(len(rows)))
        live = [row for row in rows if id(row) not in failed]
        layers = tuple(sorted({layer for row in live for layer in row.layers}))
        started = time.perf_counter()
        outputs = forward_rows([row.target for row in live], [row.block() for row in live],
                               [row.proposal.parents for row in live], layers,
                               [row.proposal.side for row in live]) if live else []
        seconds = time.perf_counter() - started
        for row, (logits, hidden) in zip(live, outputs):
            try:
                failed[id(row)] = row.settle(logits, _own_layers(hidden, layers, row.layers), seconds)
            except Exception as error:
                failed[id(row)] = RowFailure(error)
        return [failed[id(row)] for row in rows]

    def _draft(self, rows: list[_Row], cap: int | None) -> dict[int, RowFailure]:
        """Every row's draft; the rows whose drafting raised, by id(row). Rows whose drafters
        batch (a `propose_batch` static method, as ModelDrafter has) draft together, one forward
        per drafting position for all of them (a failure there fails that group's rows)."""
        failed: dict[int, RowFailure] = {}
        groups: dict[type, list[tuple[_Row, DraftRequest]]] = {}
        for row in rows:
            try:
                if row.force(self.vocab_size) or row.predict(cap, self.vocab_size):
                    continue
                request = row.request(cap)
                if request is None:
                    row.take(None, 0.0, self.vocab_size)
                else:
                    groups.setdefault(type(row.drafter), []).append((row, request))
            except Exception as error:
                failed[id(row)] = RowFailure(error)
        for kind, members in groups.items():
            if len(members) > 1 and hasattr(kind, "propose_batch"):
                started = time.perf_counter()
                try:
                    proposals = kind.propose_batch([row.drafter for row, _ in members],
                                                   [request for _, request in members])
                except Exception as error:
                    failed |= {id(row): RowFailure(error) for row, _ in members}
                    continue
                seconds = (time.perf_counter() - started) / len(members)
                for (row, _), proposal in zip(members, proposals):
                    try:
                        row.take(proposal, seconds, self.vocab_size)
                    except Exception as error:
                        failed[id(row)] = RowFailure(error)
                continue
            for row, request in members:
                started = time.perf_counter()
                try:
                    row.take(row.drafter.propose(request), time.perf_counter() - started,
                             self.vocab_size)
                except Exception as error:
                    failed[id(row)] = RowFailure(error)
        return failed

    # -- one sequence ----------------------------------------------------------------------------

    def steps(self, prompt_ids: list[int], stopping: StoppingRules,
              sampling: SamplingParams = SamplingParams(),
              seed: int | None = None, prediction: Drafter | None = None,
              constraint: Constraint | None = None) -> Iterator[Step]:
        """Run generation, yielding each step's emitted tokens as soon as they are committed.
        prediction: a drafter for this sequence alone, asked before the engine's own each step
        (verispec.drafters.prediction: the caller's predicted output); its steps are counted as
        prediction tokens. constraint: a grammar the output must match (verispec.core.grammar; the
        sequence's own, advanced as it goes)."""
        self.check_prompt(prompt_ids, stopping.max_new_tokens)
        row = self._open(prompt_ids, stopping, sampling, seed, prediction=prediction,
                         constraint=constraint)
        try:
            while True:
                (step,) = self._step([row])
                if isinstance(step, RowFailure):
                    raise step.error
                yield step
                if step.finished:
                    return
        finally:
            self._close(row)

    def generate(self, prompt_ids: list[int], stopping: StoppingRules,
                 sampling: SamplingParams = SamplingParams(),
                 seed: int | None = None,
                 on_step: Callable[[Step], None] | None = None,
                 prediction: Drafter | None = None,
                 constraint: Constraint | None = None) -> GenerationResult:
        """Run to completion and collect tokens, steps and statistics."""
        stats = self.target.stats()
        steps: list[Step] = []
        started = time.perf_counter()
        for step in self.steps(prompt_ids, stopping, sampling, seed, prediction, constraint):
            steps.append(step)
            stats.add(step)
            if on_step is not None:
                on_step(step)
        stats.total_seconds = time.perf_counter() - started
        new_tokens = [t for step in steps for t in step.tokens]
        return GenerationResult(list(prompt_ids), new_tokens, steps, stats)

    # -- a batch ---------------------------------------------------------------------------------

    def add(self, prompt_ids: list[int], stopping: StoppingRules,
            sampling: SamplingParams = SamplingParams(), seed: int | None = None,
            samples: int = 1, speculation: Speculation | None = None,
            prediction: Drafter | None = None, logprobs: int | None = None,
            constraint: Constraint | None = None) -> list[int]:
        """Start `samples` sequences of one prompt (they share its prefill); each joins the batch
        at the next `step`. Sample i is seeded with seed + i. speculation: how they draft
        (default: the engine's own; see verispec.methods.build_speculation). logprobs: each Step
        then reports its tokens' log-probabilities under the target (and this many top
        alternatives each), read from the verification pass's logits. prediction, constraint: see
        `steps` (each sample follows its own copy). Returns their ids."""
        if logprobs is not None and not 0 <= logprobs <= self.vocab_size:
            raise VerispecError(f"logprobs must be in 0..{self.vocab_size}, got {logprobs}")
        self.check_prompt(prompt_ids, stopping.max_new_tokens)
        if isinstance(samples, bool) or not isinstance(samples, int) or samples < 1:
            raise VerispecError(f"the number of samples must be a positive integer, got {samples!r}")
        ids: list[int] = []
        first = None
        try:
            for i in range(samples):
                own = prediction if i == 0 or prediction is None else copy.deepcopy(prediction)
                grammar = constraint if i == 0 or constraint is None else constraint.copy()
                row = self._open(prompt_ids, stopping, sampling, None if seed is None else seed + i,
                                 first, speculation, own, logprobs, grammar)
                first = first or row
                self._rows[self._next_id] = row
                ids.append(self._next_id)
                self._next_id += 1
        except BaseException:
            for row_id in ids:
                self.cancel(row_id)
            raise
        return ids

    def cancel(self, row_id: int) -> None:
        """Drop a sequence from the batch (a client went away); unknown ids are ignored."""
        row = self._rows.pop(row_id, None)
        if row is not None:
            self._close(row)

    @property
    def active(self) -> list[int]:
        """The ids of the sequences in the batch."""
        return list(self._rows)

    def step(self) -> list[tuple[int, Step | RowFailure]]:
        """Advance every sequence in the batch by one step; finished ones leave it, and so do
        failed ones (a RowFailure: the others' steps are as if it had not been there). Raises,
        with every sequence dropped, only if the shared target pass fails."""
        if not self._rows:
            return []
        ids = list(self._rows)
        try:
            steps = self._step([self._rows[i] for i in ids])
        except BaseException:
            for row_id in ids:  # a half-done step leaves no usable state
                self.cancel(row_id)
            raise
        for row_id, step in zip(ids, steps):
            if isinstance(step, RowFailure):  # its cache and drafter may be half-updated: dropped
                del self._rows[row_id]
            elif step.finished:
                self.cancel(row_id)
        return list(zip(ids, steps))

    def generate_batch(self, prompts: list[list[int]], stopping: StoppingRules | list[StoppingRules],
                       sampling: SamplingParams = SamplingParams(), seed: int | None = None,
                       samples: int = 1, predictions: list[Drafter | None] | None = None,
                       constraints: list[Constraint | None] | None = None) -> list[GenerationResult]:
        """Generate for every prompt together (`samples` each, one after another in the result);
        each result is what that sequence would be alone. Sequence i is seeded with seed + i.
        predictions, constraints: one per prompt (None: none), see `steps`."""
        rules = stopping if isinstance(stopping, list) else [stopping] * len(prompts)
        if len(rules) != len(prompts):
            raise VerispecError(f"{len(rules)} stopping rules for {len(prompts)} prompts")
        predictions = predictions or [None] * len(prompts)
        if len(predictions) != len(prompts):
            raise VerispecError(f"{len(predictions)} predictions for {len(prompts)} prompts")
        constraints = constraints or [None] * len(prompts)
        if len(constraints) != len(prompts):
            raise VerispecError(f"{len(constraints)} constraints for {len(prompts)} prompts")
        for prompt, rule in zip(prompts, rules):  # all valid before any work starts
            self.check_prompt(prompt, rule.max_new_tokens)
        if self._rows:
            raise VerispecError("generate_batch needs an idle engine; use add and step to join a batch")
        started = time.perf_counter()
        order: list[int] = []
        try:
            for i, (prompt, rule, prediction, constraint) in enumerate(
                    zip(prompts, rules, predictions, constraints)):
                order += self.add(prompt, rule, sampling, None if seed is None else seed + i * samples,
                                  samples, prediction=prediction, constraint=constraint)
            collected: dict[int, list[Step]] = {row_id: [] for row_id in order}
            while self._rows:
                for row_id, step in self.step():
                    if isinstance(step, RowFailure):
                        raise step.error
                    collected[row_id].append(step)
        finally:
            for row_id in list(self._rows):
                self.cancel(row_id)
        seconds = time.perf_counter() - started
        results = []
        for row_id, prompt in zip(order, (p for p in prompts for _ in range(samples))):
            stats = self.target.stats()
            for step in collected[row_id]:
                stats.add(step)
            stats.total_seconds = seconds
            tokens = [t for step in collected[row_id] for t in step.tokens]
            results.append(GenerationResult(list(prompt), tokens, collected[row_id], stats))
        return results


def token_logprobs(logits: torch.Tensor, tokens: list[int], top: int) -> list[TokenLogprob]:
    """Each token's log-probability under the target's own distribution (the raw logits, before
    any temperature or truncation: what plain decoding's logits give), with the `top` likeliest
    tokens at its position. logits: [len(tokens), vocab], row i the one that predicted tokens[i].

    >>> round(token_logprobs(torch.tensor([[0.0, 0.0]]), [1], 1)[0].logprob, 4)
    -0.6931
    """
    logprobs = logits.float().log_softmax(-1)  # [n, vocab]
    chosen = logprobs.gather(-1, torch.tensor(tokens, device=logits.device)[:, None])[:, 0].tolist()
    best = logprobs.topk(top, -1) if top else None
    return [TokenLogprob(token, value, () if best is None else tuple(zip(best.indices[i].tolist(),
                                                                        best.values[i].tolist())))
            for i, (token, value) in enumerate(zip(tokens, chosen))]


def _own_layers(hidden: torch.Tensor, layers: tuple[int, ...], own: tuple[int, ...]) -> torch.Tensor:
    """A row's share of hidden [n, hidden * (1 + len(layers))]: the final states, then those
    after its own `own` layers (a subset of `layers`)."""
    if own == layers:
        return hidden
    width = hidden.shape[1] // (1 + len(layers))
    parts = [hidden[:, :width]] + [hidden[:, width * (1 + layers.index(layer)):
                                          width * (2 + layers.index(layer))] for layer in own]
    return torch.cat(parts, dim=1)
