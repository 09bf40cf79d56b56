"""Plain data passed between the engine, drafters and verifiers.

Vocabulary used throughout verispec:
  target_probs  -- the target model's next-token distribution (p), after sampling warps
  draft_probs   -- the drafter's distribution (q), after the same warps; None = deterministic
  accepted      -- a draft token the verifier kept
  recovered     -- the token the verifier emits at the first rejected position (a correction)
  bonus         -- the token emitted after a fully accepted draft, from the target alone
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import Enum

import torch

from verispec.core.errors import VerispecError
from verispec.core.tree import chain_parents, depths

# Temperatures below this mean greedy decoding (vLLM's floor too): logits divided by less can
# overflow float32 to inf (1e-40 is a subnormal float32, 1e-50 rounds to 0), and softmax of inf
# is NaN. Down here the warped distribution is one-hot on the argmax but for logits within a few
# 1e-5 of it, which greedy decoding settles as the argmax does.
GREEDY_BELOW = 1e-5


@dataclass(frozen=True)
class SamplingParams:
    """How the next token is chosen; applied identically to target and draft distributions.

    temperature < GREEDY_BELOW (0 included) or do_sample=False means greedy decoding. top_k == 0
    and top_p == 1 disable those truncations.
    """

    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0

    def __post_init__(self) -> None:
        if not isinstance(self.temperature, (int, float)) or not math.isfinite(self.temperature):
            raise VerispecError(f"temperature must be a finite number, got {self.temperature!r}")
        if self.temperature < 0:
            raise VerispecError(f"temperature must be >= 0, got {self.temperature}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise VerispecError(f"top_k must be an integer >= 0 (0 disables it), got {self.top_k!r}")
        if not (isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1):
            raise VerispecError(f"top_p must be in (0, 1], got {self.top_p!r}")

    @property
    def greedy(self) -> bool:
        return not self.do_sample or self.temperature < GREEDY_BELOW

    @staticmethod
    def of(temperature: float | None = None, top_k: int | None = None, top_p: float | None = None,
           do_sample: bool | None = None) -> SamplingParams:
        """Sampling settings from what a user gave, the library's defaults for the rest: the one
        place every front door (API, CLI, bench, server) builds them. do_sample None: sample
        when a temperature above 0 is given (the CLI's and OpenAI's reading); True: sample at
        `temperature` (default 1); False: greedy whatever the temperature (Hugging Face's).

        >>> SamplingParams.of(temperature=0.7).do_sample, SamplingParams.of().greedy
        (True, True)
        """
        if do_sample is not None and not isinstance(do_sample, bool):
            raise VerispecError(f"do_sample must be true or false, got {do_sample!r}")
        sample = (temperature is not None and isinstance(temperature, (int, float))
                  and temperature > 0) if do_sample is None else do_sample
        return SamplingParams(sample, 1.0 if temperature is None else temperature,
                              0 if top_k is None else top_k, 1.0 if top_p is None else top_p)


@dataclass(frozen=True)
class SideBranch:
    """Tokens a drafter has the target score in the same forward as its draft, never verified.

    They follow the draft in the block [root, draft nodes, side tokens] with their own attention
    pattern and positions; the engine hands their logits to the drafter's `observe_side` and drops
    them from the target's cache (lookahead decoding's Jacobi window; see verispec.core.tree.side_block).
    Draft rows never see side rows, so the draft's logits are what they would be without them.
    """

    tokens: torch.Tensor  # [m] int64
    offsets: torch.Tensor  # [m] int64: each token's position minus the root's (>= 1)
    mask: torch.Tensor  # [m, 1 + num_draft + m] bool: the block rows each side token attends to


class DraftSource(Enum):
    """Where a step's draft came from: the method's drafter, the caller's predicted output
    (OpenAI's `prediction`), or the grammar's forced tokens (proposed for free, always kept)."""

    DRAFTER = "drafter"
    PREDICTION = "prediction"
    GRAMMAR = "grammar"


@dataclass(frozen=True)
class Proposal:
    """Draft tokens for one step: a chain, or a token tree (see verispec.core.tree).

    A deterministic drafter leaves draft_probs None (one-hot q). In a tree, draft_probs[i] is the
    distribution node i was drawn from, given its parent and the siblings drawn before it. `side`:
    extra tokens scored alongside the draft but never accepted (see SideBranch); None for most.
    A drafter with another tokenizer (verispec.drafters.cross) says how many of its own tokens
    the draft took (`foreign_tokens`) and how many of those were lost at the tokenizer boundary
    (`boundary_lost`: their text did not reach the target's tokens proposed). A drafter that
    chooses among others each step (`auto`) names its choice: (method, k).
    """

    tokens: torch.Tensor  # [num_draft] int64
    draft_probs: torch.Tensor | None = None  # [num_draft, vocab] float32, rows sum to 1
    parents: torch.Tensor | None = None  # [num_draft] int64, -1 = child of the root; None = chain
    side: SideBranch | None = None
    source: DraftSource = DraftSource.DRAFTER
    foreign_tokens: int = 0
    boundary_lost: int = 0
    choice: tuple[str, int] | None = None

    def __len__(self) -> int:
        return int(self.tokens.shape[0])

    @property
    def tree_parents(self) -> torch.Tensor:
        """The parents of every node, a chain's included. [num_draft] int64."""
        if self.parents is None:
            return chain_parents(len(self), self.tokens.device)
        return self.parents

    @property
    def depth(self) -> int:
        """Tokens on the longest root-to-leaf path (len(self) for a chain)."""
        if self.parents is None:
            return len(self)
        return int(depths(self.parents).max())


@dataclass(frozen=True)
class Verdict:
    """What verification decided: keep the draft nodes on `path` (root to leaf), then next_token.

    For a chain the path is 0..num_accepted-1.
    """

    path: tuple[int, ...]  # accepted node indices, root-most first
    next_token: int  # recovered token if the path stops before a leaf, else the bonus token

    @property
    def num_accepted(self) -> int:
        return len(self.path)


@dataclass(frozen=True)
class DraftTree:
    """A verified token tree as plain lists (see verispec.core.tree)."""

    tokens: list[int]
    parents: list[int]  # -1 = child of the root
    path: list[int]  # accepted nodes, root-most first
    depth: int


class Fate(Enum):
    """Why a token is in the output: drafted and accepted, forced by the grammar (proposed for
    free, kept with probability 1), a target correction, or a bonus."""

    ACCEPTED = "accepted"
    FORCED = "forced"
    RECOVERED = "recovered"
    BONUS = "bonus"


@dataclass(frozen=True)
class TokenLogprob:
    """A generated token's log-probability under the target, and the likeliest tokens there."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # (token, logprob), likeliest first


@dataclass(frozen=True, kw_only=True)
class Step:
    """One draft-verify-commit cycle as the user sees it (after stopping rules cut it)."""

    tokens: list[int]  # emitted tokens, in order
    fates: list[Fate]  # one per emitted token
    rejected: list[int] = field(default_factory=list)  # draft tokens the verifier refused (display)
    num_drafted: int = 0
    num_accepted: int = 0  # as decided by the verifier, before stopping rules cut the block
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    finished: bool = False
    # A tree proposal (None for a chain): its tokens, parents and accepted path, for display.
    tree: DraftTree | None = None
    source: DraftSource = DraftSource.DRAFTER  # where the draft came from
    logprobs: list[TokenLogprob] | None = None  # one per emitted token, when asked for
    foreign_tokens: int = 0  # draft-model tokens in another vocabulary behind the draft (Proposal)
    boundary_lost: int = 0  # ... whose text did not reach the target's tokens proposed
    choice: tuple[str, int] | None = None  # what a choosing drafter chose: (method, k) (Proposal)

    @property
    def draft_depth(self) -> int:
        """Draft positions this step covered: the tree's depth, or the chain's length."""
        return self.num_drafted if self.tree is None else self.tree.depth


def _add_counts(counts: list[int], more: list[int]) -> None:
    """counts[i] += more[i], growing counts as needed."""
    counts.extend([0] * (len(more) - len(counts)))
    for i, count in enumerate(more):
        counts[i] += count


@dataclass
class GenerationStats:
    """Counters accumulated over a generation; see GenerationResult.stats()."""

    new_tokens: int = 0
    target_forwards: int = 0
    drafted_by_position: list[int] = field(default_factory=list)  # steps drafting position i
    accepted_by_position: list[int] = field(default_factory=list)  # ... where i was accepted
    reached_by_position: list[int] = field(default_factory=list)  # ... 0..i-1 accepted, i judged
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    total_seconds: float = 0.0
    # Draft tokens taken from the caller's prediction that the target kept / refused (OpenAI's
    # usage.completion_tokens_details names).
    accepted_prediction_tokens: int = 0
    rejected_prediction_tokens: int = 0
    forced_tokens: int = 0  # tokens the grammar forced, drafted for free (verispec.core.grammar)
    # A drafter with another tokenizer (verispec.drafters.cross): the tokens its draft model
    # made, and those of them whose text was lost at the tokenizer boundary (not proposed).
    foreign_tokens: int = 0
    boundary_lost: int = 0
    invariance: str = ""  # the target's batch-invariance mode (CachedModel.invariance); "" unknown
    dtype: str = ""  # what the target's weights are in (CachedModel.precision): float32 ... int4
    kernel: str = ""  # how its products run (CachedModel.kernel)
    path: str = ""  # which forward runs it: "lean (FAMILY)" or Hugging Face's (CachedModel.path)
    # A choosing drafter's stretches (`auto`): (index of the stretch's first new token, method,
    # the longest draft it chose there), a new one wherever the method changes (in a total, each
    # generation's after the ones before).
    choices: list[tuple[int, str, int]] = field(default_factory=list)

    def add(self, step: Step) -> None:
        if step.choice is not None:
            method, k = step.choice
            if self.choices and self.choices[-1][1] == method:
                start, _, longest = self.choices[-1]
                self.choices[-1] = (start, method, max(longest, k))
            else:
                self.choices.append((self.new_tokens, method, k))
        self.new_tokens += len(step.tokens)
        if step.source is DraftSource.PREDICTION:
            self.accepted_prediction_tokens += step.num_accepted
            self.rejected_prediction_tokens += step.num_drafted - step.num_accepted
        self.target_forwards += 1
        if step.source is DraftSource.GRAMMAR:  # not the drafter's guesses: kept out of its acceptance
            self.forced_tokens += step.fates.count(Fate.FORCED)
            self.draft_seconds += step.draft_seconds
            self.verify_seconds += step.verify_seconds
            return
        # Positions the verifier judged: the accepted ones and, where the draft went on past
        # them, the first refused. In a tree that is where the accepted node has children
        # (`rejected`), not wherever the tree is deeper than the accepted path.
        reached = (min(step.draft_depth, step.num_accepted + 1) if step.tree is None
                   else step.num_accepted + bool(step.rejected))
        _add_counts(self.drafted_by_position, [1] * step.draft_depth)
        _add_counts(self.accepted_by_position, [1] * step.num_accepted)
        _add_counts(self.reached_by_position, [1] * reached)
        self.foreign_tokens += step.foreign_tokens
        self.boundary_lost += step.boundary_lost
        self.draft_seconds += step.draft_seconds
        self.verify_seconds += step.verify_seconds

    @staticmethod
    def total(all_stats: list[GenerationStats]) -> GenerationStats:
        """Counters summed over several generations (for per-task or per-run totals)."""
        total = GenerationStats()
        for s in all_stats:
            total.choices += [(start + total.new_tokens, method, k) for start, method, k in s.choices]
            total.new_tokens += s.new_tokens
            total.target_forwards += s.target_forwards
            _add_counts(total.drafted_by_position, s.drafted_by_position)
            _add_counts(total.accepted_by_position, s.accepted_by_position)
            _add_counts(total.reached_by_position, s.reached_by_position)
            total.draft_seconds += s.draft_seconds
            total.verify_seconds += s.verify_seconds
            total.total_seconds += s.total_seconds
            total.accepted_prediction_tokens += s.accepted_prediction_tokens
            total.rejected_prediction_tokens += s.rejected_prediction_tokens
            total.forced_tokens += s.forced_tokens
            total.foreign_tokens += s.foreign_tokens
            total.boundary_lost += s.boundary_lost
        for name in ("invariance", "dtype", "kernel", "path"):
            setattr(total, name, "/".join(sorted({getattr(s, name) for s in all_stats})))
        return total

    @property
    def mean_accepted_tokens(self) -> float:
        """tau: new tokens per target forward pass (1.0 for plain decoding)."""
        return self.new_tokens / self.target_forwards if self.target_forwards else 0.0

    @property
    def acceptance_by_position(self) -> list[float]:
        """Per draft position i: P(accepted | drafted and positions 0..i-1 accepted), up to the
        last position reached (accepted_by_position stops at the last position ever accepted).

        >>> GenerationStats(accepted_by_position=[3, 1], reached_by_position=[4, 3, 1]).acceptance_by_position
        [0.75, 0.3333333333333333, 0.0]
        """
        accepted = self.accepted_by_position + [0] * (len(self.reached_by_position)
                                                      - len(self.accepted_by_position))
        rates = []
        for a, r in zip(accepted, self.reached_by_position):
            if r <= 0:
                break
            rates.append(a / r)
        return rates

    @property
    def boundary_lost_share(self) -> float | None:
        """Of the draft model's tokens in another vocabulary, the share lost at the tokenizer
        boundary (None: no such drafter ran)."""
        return self.boundary_lost / self.foreign_tokens if self.foreign_tokens else None

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.total_seconds if self.total_seconds > 0 else 0.0

    def as_dict(self) -> dict:
        return {
            "new_tokens": self.new_tokens,
            "target_forwards": self.target_forwards,
            "mean_accepted_tokens": self.mean_accepted_tokens,
            "acceptance_by_position": self.acceptance_by_position,
            "draft_seconds": self.draft_seconds,
            "verify_seconds": self.verify_seconds,
            "tokens_per_second": self.tokens_per_second,
            "accepted_prediction_tokens": self.accepted_prediction_tokens,
            "rejected_prediction_tokens": self.rejected_prediction_tokens,
            "forced_tokens": self.forced_tokens,
            "foreign_tokens": self.foreign_tokens,
            "boundary_lost": self.boundary_lost,
            "invariance": self.invariance,
            "dtype": self.dtype,
            "kernel": self.kernel,
            "path": self.path,
            "choices": [list(choice) for choice in self.choices],
        }


@dataclass
class GenerationResult:
    """Output of one generation: prompt + new token ids, the steps that made them, statistics."""

    prompt_ids: list[int]
    token_ids: list[int]  # new tokens only
    steps: list[Step]
    stats: GenerationStats
    text: str | None = None  # decoded new tokens, when a tokenizer is known

    @property
    def sequence(self) -> list[int]:
        return self.prompt_ids + self.token_ids
