"""The decode loop: propose -> verify -> commit -> adapt the draft length, for one sequence or a
batch of them.

The engine owns the target's KV caches (one per sequence) and rewinds each once per step, after
verification. Each drafter owns and rewinds its own state; verifiers are pure. Invariant at the
start of a step: a sequence's target cache holds every committed token but the last, which is fed
together with the draft, so one forward of 1 + k tokens scores all k drafts and yields the token
after them.

A batch steps every sequence together: each drafts on its own (its own drafter, k and state), one
target pass verifies every sequence's block (verispec.model.cached_model.forward_rows: the weights are
read once for all rows), and each accepts its own number of tokens and rewinds its own cache.
Sequences join (`add`) and leave (finished, or `cancel`) between steps: continuous batching.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace

import torch
from transformers import PreTrainedModel

from verispec.core.errors import VerispecError
from verispec.core.grammar import Constraint
from verispec.core.policies import ConstantK, DraftLengthPolicy, LoadCap
from verispec.core.stopping import StoppingRules
from verispec.core.tree import check_parents
from verispec.core.types import (
    DraftSource,
    DraftTree,
    Fate,
    GenerationResult,
    Proposal,
    SamplingParams,
    Step,
    TokenLogprob,
)
from verispec.decoding.constrained import GrammarStop, constrain
from verispec.drafters.base import Drafter, DraftRequest
from verispec.drafters.prediction import PredictionFirst
from verispec.model.cached_model import CachedModel, forward_rows
from verispec.verifiers import verifier_for


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
class SequenceSpec:
    """What one sequence decodes: its prompt, when it stops, how it samples, and what the caller
    adds for it alone: a predicted output's token ids (drafted first wherever the output is in
    it), a grammar the output must match (this sequence advances its own copy), and how many top
    alternatives to report with each token's log-probability under the target, read from the
    verification pass's logits (None: no logprobs). The engine takes it as checked (a Request's)."""

    prompt_ids: list[int]
    stopping: StoppingRules
    sampling: SamplingParams = SamplingParams()
    seed: int | None = None
    prediction: list[int] | None = None
    constraint: Constraint | None = None
    logprobs: int | None = None

    @staticmethod
    def batch(prompts: list[list[int]], stopping: StoppingRules | list[StoppingRules],
              sampling: SamplingParams = SamplingParams(), seed: int | None = None,
              sequences: int = 1) -> list[SequenceSpec]:
        """Specs for several prompts (one stopping rule for all, or one each), each to decode
        `sequences` sequences, seeded by `sequence_seed`."""
        rules = stopping if isinstance(stopping, list) else [stopping] * len(prompts)
        if len(rules) != len(prompts):
            raise VerispecError(f"{len(rules)} stopping rules for {len(prompts)} prompts")
        return [SequenceSpec(prompt, rule, sampling, sequence_seed(seed, i, sequences))
                for i, (prompt, rule) in enumerate(zip(prompts, rules))]


def sequence_seed(seed: int | None, prompt: int, sequences: int = 1, sequence: int = 0) -> int | None:
    """The one seeding rule: sequence j of prompt i (`sequences` per prompt) is seeded with
    seed + i * sequences + j, so no two sequences of a request share a seed (None: unseeded).

    >>> [sequence_seed(10, prompt, 2, sequence) for prompt in (0, 1) for sequence in (0, 1)]
    [10, 11, 12, 13]
    """
    return None if seed is None else seed + prompt * sequences + sequence


@dataclass(frozen=True)
class RowFailure:
    """A sequence whose own part of a step raised (its drafter, its draft's checks, its
    verification): it has left the batch, and the other sequences' steps went on unchanged."""

    error: Exception


class _Row:
    """One sequence being generated: its target cache, drafter, policy, verifier, randomness and
    tokens. A step: (1) draft, (2) the engine runs the shared target pass over `block()`, (3)
    `settle`: verify, keep the accepted rows in the caches, commit, cut by the stopping rules."""

    def __init__(self, spec: SequenceSpec, speculation: Speculation, target: CachedModel,
                 drafter: Drafter | None, hidden_size: int) -> None:
        device = target.device
        self.speculation, self.target = speculation, target
        self.pooled = drafter  # the speculation's own drafter (wrapped below), back to the pool after
        self.policy = copy.deepcopy(speculation.policy)
        self.sampling, self.logprobs = spec.sampling, spec.logprobs
        self.generator = torch.Generator(device=device)
        if spec.seed is None:
            self.generator.seed()
        else:  # as torch reads seeds < 0; seed + i may pass 2**64
            self.generator.manual_seed(spec.seed % 2**64)
        verifier = verifier_for(spec.sampling, speculation.acceptance)
        stopping: StoppingRules | GrammarStop = spec.stopping
        if spec.prediction is not None:
            drafter = PredictionFirst(spec.prediction, drafter)
        if spec.constraint is not None:
            drafter, verifier, stopping = constrain(spec.constraint, drafter, verifier, stopping)
        self.drafter, self.verifier, self.stopping = drafter, verifier, stopping
        tokens = torch.tensor(spec.prompt_ids, dtype=torch.int64, device=device)
        self.buffer = torch.cat([tokens, tokens.new_zeros(stopping.max_new_tokens)])  # [prompt + new]
        self.length = len(spec.prompt_ids)
        self.generated: list[int] = []
        self.layers = () if drafter is None else drafter.hidden_layers  # intermediate states wanted
        # The target's hidden state per committed position, for drafters that read it.
        self.hidden = None
        if drafter is not None and drafter.needs_hidden:
            self.hidden = torch.empty(self.buffer.shape[0], hidden_size * (1 + len(self.layers)),
                                      device=device, dtype=target.model.dtype)  # [prompt + new, .]
        self.proposal = Proposal(self.buffer[:0])
        self.asked = False  # the drafter proposed this step (commit follows)
        self.draft_seconds = 0.0

    def prefill(self, source: _Row | None = None) -> None:
        """Cache the prompt (all of it but the last token), or copy it from `source`, a row with
        the same prompt (samples of one prompt share its prefill)."""
        self.target.reset()
        if self.drafter is not None:
            self.drafter.reset()
        if self.length == 1:
            return
        if source is None:
            prompt_hidden = self.target.prefill(self.buffer[: self.length - 1], self.layers)
        else:
            self.target.copy_from(source.target)
            prompt_hidden = None if source.hidden is None else source.hidden[: self.length - 1]
        if self.hidden is not None:
            self.hidden[: self.length - 1] = prompt_hidden
        if self.drafter is not None and self.drafter.adopts_prefill:
            self.drafter.adopt_prefill(self.target)

    def request(self, cap: int | None, batch: int = 1) -> DraftRequest | None:
        """What to ask the drafter this step (None: nothing): the policy's k within the room
        left, which is the token budget (a step always adds one target token after the draft)
        and the batch's cap; `batch` sequences share the step's target pass. A drafter that
        `uses_room` is asked every step, even with no room (a grammar computes its masks then)."""
        room = self.stopping.max_new_tokens - len(self.generated) - 1
        if cap is not None:
            room = min(room, cap)
        k = min(self.policy.next_k(), room)
        if self.drafter is None or (k < 1 and not self.drafter.uses_room):
            return None
        hidden = None if self.hidden is None else self.hidden[: self.length - 1]
        return DraftRequest(self.buffer[: self.length], k, self.sampling, self.generator, hidden, room,
                            batch)

    def take(self, proposal: Proposal | None, seconds: float, vocab_size: int) -> None:
        """This step's draft (None: the drafter was not asked) and the seconds it took."""
        self.asked = proposal is not None
        proposal = Proposal(self.buffer[:0]) if proposal is None else proposal
        if proposal.parents is not None:  # a drafter's tree must be well formed
            check_parents(proposal.parents)
        if len(proposal) and not 0 <= int(proposal.tokens.min()) <= int(proposal.tokens.max()) < vocab_size:
            # Caught here, a bad draft fails its own row, not the batch's shared forward.
            raise VerispecError(f"the drafter proposed a token outside the vocabulary (0..{vocab_size - 1})")
        self.proposal, self.draft_seconds = proposal, seconds

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
        verdict = self.verifier.verify(proposal, logits, self.sampling, self.generator)
        path, accepted = list(verdict.path), verdict.num_accepted
        rows = [0] + [node + 1 for node in path]  # block rows to keep: root + accepted path
        if self.hidden is not None:
            self.hidden[self.length - 1: self.length + accepted] = block_hidden[rows]
        self.target.keep(self.length - 1, rows)
        if self.asked:
            self.drafter.commit(accepted)
            if proposal.source is DraftSource.DRAFTER:
                self.policy.update(proposal.depth, accepted)

        parents = proposal.tree_parents.tolist()
        drafted_tokens = proposal.tokens.tolist()
        end = path[-1] if path else -1
        alternatives = [drafted_tokens[i] for i, parent in enumerate(parents) if parent == end]
        block = [drafted_tokens[i] for i in path] + [verdict.next_token]
        kept = Fate.FORCED if proposal.source is DraftSource.GRAMMAR else Fate.ACCEPTED
        fates = [kept] * accepted + [Fate.RECOVERED if alternatives else Fate.BONUS]
        keep, finished = self.stopping.cut(self.generated, block)
        logprobs = None if self.logprobs is None else token_logprobs(logits[rows[:keep]], block[:keep],
                                                                     self.logprobs)
        self.buffer[self.length: self.length + keep] = torch.tensor(block[:keep])
        self.length += keep
        self.generated += block[:keep]
        tree = None if proposal.parents is None else DraftTree(drafted_tokens, parents, path, proposal.depth)
        return Step(tokens=block[:keep], fates=fates[:keep], rejected=alternatives,
                    num_drafted=len(proposal), num_accepted=accepted, draft_seconds=self.draft_seconds,
                    verify_seconds=forward_seconds + time.perf_counter() - started, finished=finished,
                    tree=tree, source=proposal.source, logprobs=logprobs,
                    foreign_tokens=proposal.foreign_tokens, boundary_lost=proposal.boundary_lost,
                    choice=proposal.choice)


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
        """drafter, policy, acceptance, spawn: the engine's own Speculation (see it; policy default:
        k = 5 with a drafter). load_cap: the draft length allowed per sequence at each batch size
        (default: measured)."""
        self.model = target
        self.target = CachedModel(target)
        self.drafter = drafter
        self.speculation = Speculation(drafter, policy or ConstantK(0 if drafter is None else 5),
                                       acceptance, spawn)
        self.load_cap = load_cap or LoadCap()
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

    # -- rows: a cache and a drafter each, taken from the pool and given back -------------------

    def _open(self, spec: SequenceSpec, speculation: Speculation | None = None,
              source: _Row | None = None) -> _Row:
        """A row for `spec` with a cache and drafter from the pool of `speculation` (default: the
        engine's), prefilled (or copied from `source`, a row with the same prompt)."""
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
            row = _Row(spec, speculation, target, drafter, self.hidden_size)
            row.prefill(source)
        except BaseException:  # a bad setting or a failed prefill: the cache and drafter go back
            free.append((target, drafter))
            raise
        return row

    def _close(self, row: _Row) -> None:
        """The row's cache and drafter go back to the pool, emptied: an idle one holds no KV."""
        row.target.reset()
        if row.pooled is not None:
            row.pooled.reset()
        free = self._free[row.speculation]
        if len(free) < self.pool_limit.get(row.speculation, len(free) + 1):
            free.append((row.target, row.pooled))

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
        # By id(row): the rows whose drafting failed, then every row's outcome.
        outcomes: dict[int, Step | RowFailure] = dict(self._draft(rows, self.load_cap.k(len(rows))))
        live = [row for row in rows if id(row) not in outcomes]
        layers = tuple(sorted({layer for row in live for layer in row.layers}))
        started = time.perf_counter()
        outputs = forward_rows([row.target for row in live], [row.block() for row in live],
                               [row.proposal.parents for row in live], layers,
                               [row.proposal.side for row in live]) if live else []
        seconds = time.perf_counter() - started
        for row, (logits, hidden) in zip(live, outputs):
            try:
                outcomes[id(row)] = row.settle(logits, _own_layers(hidden, layers, row.layers), seconds)
            except Exception as error:
                outcomes[id(row)] = RowFailure(error)
        return [outcomes[id(row)] for row in rows]

    def _draft(self, rows: list[_Row], cap: int | None) -> dict[int, RowFailure]:
        """Every row's draft; the rows whose drafting raised, by id(row). Rows whose drafters
        declare `batches` (ModelDrafter does) draft together through `propose_batch`, one forward
        per drafting position for all of them (a failure there fails that group's rows)."""
        failures: dict[int, RowFailure] = {}
        groups: dict[type, list[tuple[_Row, DraftRequest]]] = {}
        for row in rows:
            try:
                request = row.request(cap, len(rows))
                if request is None:
                    row.take(None, 0.0, self.vocab_size)
                else:
                    groups.setdefault(type(row.drafter), []).append((row, request))
            except Exception as error:
                failures[id(row)] = RowFailure(error)
        for kind, members in groups.items():
            together = len(members) > 1 and kind.batches  # else each row's own `propose`
            for call in [members] if together else [[member] for member in members]:
                started = time.perf_counter()
                try:
                    proposals = (kind.propose_batch if together else Drafter.propose_batch)(
                        [row.drafter for row, _ in call], [request for _, request in call])
                except Exception as error:
                    failures |= {id(row): RowFailure(error) for row, _ in call}
                    continue
                seconds = (time.perf_counter() - started) / len(call)
                for (row, _), proposal in zip(call, proposals):
                    try:
                        row.take(proposal, seconds, self.vocab_size)
                    except Exception as error:
                        failures[id(row)] = RowFailure(error)
        return failures

    # -- one sequence ----------------------------------------------------------------------------

    def steps(self, spec: SequenceSpec) -> Iterator[Step]:
        """Run generation, yielding each step's emitted tokens as soon as they are committed (a
        spec's constraint is advanced as the sequence goes: give a fresh copy)."""
        row = self._open(spec)
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

    def generate(self, spec: SequenceSpec, on_step: Callable[[Step], None] | None = None) -> GenerationResult:
        """Run to completion and collect tokens, steps and statistics; on_step sees each step."""
        steps: list[Step] = []
        started = time.perf_counter()
        for step in self.steps(spec):
            steps.append(step)
            if on_step is not None:
                on_step(step)
        return self._result(spec, steps, time.perf_counter() - started)

    def _result(self, spec: SequenceSpec, steps: list[Step], seconds: float) -> GenerationResult:
        """One sequence's result from its steps, `seconds` the time it took."""
        stats = self.target.stats()
        for step in steps:
            stats.add(step)
        stats.total_seconds = seconds
        tokens = [t for step in steps for t in step.tokens]
        return GenerationResult(list(spec.prompt_ids), tokens, steps, stats)

    # -- a batch ---------------------------------------------------------------------------------

    def add(self, spec: SequenceSpec, sequences: int = 1,
            speculation: Speculation | None = None) -> list[int]:
        """Start `sequences` sequences of `spec` (they share its prefill; each is seeded by
        `sequence_seed` and follows its own copy of the constraint); each joins the batch at the
        next `step`. speculation: how they draft (default: the engine's own; see
        verispec.methods.build_speculation). Returns their ids."""
        ids: list[int] = []
        first = None
        try:
            for i in range(sequences):
                own = spec if i == 0 else replace(
                    spec, seed=sequence_seed(spec.seed, 0, sequence=i),
                    constraint=None if spec.constraint is None else spec.constraint.copy())
                row = self._open(own, speculation, first)
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

    def generate_batch(self, specs: list[SequenceSpec], sequences: int = 1) -> list[GenerationResult]:
        """Generate every sequence together (`sequences` of each spec, one after another in the
        result, seeded as `add` seeds them); each result is what that sequence would be alone."""
        if self._rows:
            raise VerispecError("generate_batch needs an idle engine; use add and step to join a batch")
        started = time.perf_counter()
        order: list[int] = []
        try:
            for spec in specs:
                order += self.add(spec, sequences)
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
        return [self._result(spec, collected[row_id], seconds)
                for row_id, spec in zip(order, (s for s in specs for _ in range(sequences)))]


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
    keep = [0] + [1 + layers.index(layer) for layer in own]  # the final states, then own layers'
    return hidden.reshape(hidden.shape[0], 1 + len(layers), -1)[:, keep].flatten(1)  # [n, .]
