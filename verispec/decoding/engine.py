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

A sequence's own part of a step (its draft request, verification, commit and rewind) is a `Row`
(verispec.decoding.sequence); this module is the batch around the rows: the pool of caches and
drafters, the one target pass they share, and a row's failure kept its own.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch

from verispec.core.errors import VerispecError
from verispec.core.policies import ConstantK, DraftLengthPolicy, LoadCap
from verispec.core.types import GenerationResult, Step
from verispec.decoding.sequence import Row, SequenceSpec, Speculation, sequence_seed
from verispec.drafters.base import Drafter, DraftRequest
from verispec.model.cached_model import CachedModel, forward_rows

if TYPE_CHECKING:
    from transformers import PreTrainedModel


@dataclass(frozen=True)
class RowFailure:
    """A sequence whose own part of a step raised (its drafter, its draft's checks, its
    verification): it has left the batch, and the other sequences' steps went on unchanged."""

    error: Exception


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
        # server bounds the pools of the ways its clients choose (each idle pair keeps its KV
        # caches; drafters of one trained network share its weights).
        self.pool_limit: dict[Speculation, int] = {}
        self._rows: dict[int, Row] = {}
        self._next_id = 0

    # -- rows: a cache and a drafter each, taken from the pool and given back -------------------

    def _open(self, spec: SequenceSpec, speculation: Speculation | None = None,
              source: Row | None = None) -> Row:
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
            row = Row(spec, speculation, target, drafter, self.hidden_size)
            row.prefill(source)
        except BaseException:  # a bad setting or a failed prefill: the cache and drafter go back
            free.append((target, drafter))
            raise
        return row

    def _close(self, row: Row) -> None:
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

    def _step(self, rows: list[Row]) -> list[Step | RowFailure]:
        """One draft-verify-commit cycle for every row, with one target pass for all of them.
        A row whose own drafting or settling raises gets a RowFailure and the others go on; only
        the shared forward failing fails them all (it raises)."""
        # By id(row): the rows whose drafting failed, then every row's outcome.
        outcomes: dict[int, Step | RowFailure] = dict(self._draft(rows, self.load_cap.k(len(rows))))
        live = [row for row in rows if id(row) not in outcomes]
        layers = tuple(sorted({layer for row in live for layer in row.layers}))
        blocks = [row.block() for row in live]
        started = time.perf_counter()
        outputs = forward_rows([row.target for row in live], blocks, [row.proposal.parents for row in live],
                               layers, [row.proposal.side for row in live]) if live else []
        seconds = time.perf_counter() - started
        rows_scored = sum(len(block) for block in blocks)
        for row, (logits, hidden) in zip(live, outputs):
            try:
                outcomes[id(row)] = row.settle(logits, _own_layers(hidden, layers, row.layers), seconds,
                                               rows_scored)
            except Exception as error:
                outcomes[id(row)] = RowFailure(error)
        return [outcomes[id(row)] for row in rows]

    def _draft(self, rows: list[Row], cap: int | None) -> dict[int, RowFailure]:
        """Every row's draft; the rows whose drafting raised, by id(row). Rows whose drafters
        declare `batches` (ModelDrafter does) draft together through `propose_batch`, one forward
        per drafting position for all of them (a failure there fails that group's rows)."""
        failures: dict[int, RowFailure] = {}
        groups: dict[type, list[tuple[Row, DraftRequest]]] = {}
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


def _own_layers(hidden: torch.Tensor, layers: tuple[int, ...], own: tuple[int, ...]) -> torch.Tensor:
    """A row's share of hidden [n, hidden * (1 + len(layers))]: the final states, then those
    after its own `own` layers (a subset of `layers`)."""
    if own == layers:
        return hidden
    keep = [0] + [1 + layers.index(layer) for layer in own]  # the final states, then own layers'
    return hidden.reshape(hidden.shape[0], 1 + len(layers), -1)[:, keep].flatten(1)  # [n, .]
