"""One sequence's part of decoding: what it decodes (`SequenceSpec`, seeded by `sequence_seed`),
how it speculates (`Speculation`), and its state through a step (`Row`: the draft request, the
block the target scores, then verify, commit and rewind its own cache and drafter).

The engine (verispec.decoding.engine) holds the rows of a batch: it pools their caches and
drafters, runs the one target pass they share and keeps a row's failure its own. Nothing here
knows about other sequences.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from verispec.core.errors import VerispecError
from verispec.core.grammar import Constraint
from verispec.core.policies import ConstantK, DraftLengthPolicy
from verispec.core.stopping import StoppingRules
from verispec.core.tree import check_parents
from verispec.core.types import (
    DraftSource,
    DraftTree,
    Fate,
    Proposal,
    SamplingParams,
    Step,
    TokenLogprob,
)
from verispec.decoding.constrained import GrammarStop, constrain
from verispec.drafters.base import Drafter, DraftRequest
from verispec.drafters.prediction import PredictionFirst
from verispec.model.cached_model import CachedModel
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


class Row:
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
        self.seeded = spec.seed is not None
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

    def prefill(self, source: Row | None = None) -> None:
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
                            batch, self.seeded)

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

    def settle(self, logits: torch.Tensor, block_hidden: torch.Tensor, forward_seconds: float,
               forward_rows: int) -> Step:
        """Verify the draft against the target's logits [1 + k (+ m side rows), vocab]
        (block_hidden [1 + k (+ m), .]: the states this row's drafter reads), commit, rewind what
        was refused. The target's forward scored `forward_rows` rows (every row's block) in
        `forward_seconds`."""
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
            self.drafter.observe_forward(forward_rows, forward_seconds)
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
