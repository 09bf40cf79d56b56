"""`auto`: the drafter (and draft length) with the most expected tokens per second, chosen every
step from the machine's cost profile and the acceptance observed so far; plain decoding when no
drafter pays.

The standard model (Leviathan et al. 2022): a drafter whose tokens are each accepted with
probability a, drafting k, yields E(a, k) = (1 - a^(k+1)) / (1 - a) tokens per step, and a step
costs the target's forward over the verified rows plus the draft: with `batch` sequences sharing
the target pass, T(batch * (k + 1)) / batch + draft(k) per sequence. Plain decoding (k = 0) is
always a candidate: E = 1, T(batch) / batch.

Candidates are lookups (suffix decoding, prompt lookup: nearly free, drafting only where the
context repeats, so a lookup is a candidate only on steps where it offers a draft) and model
drafters (the target's own weights in low precision, a trained drafter shipped for the target:
a draft every step at a cost per token).
The costs start from the profile and follow what this run's steps took: a model drafter's
proposals (its slowdown), the target's forwards over each number of rows (`Pace`), and what a
step costs besides (verification, bookkeeping: `overhead`, paid once a token by plain decoding and
once a step by a draft). A model drafter that sat out a stretch re-reads it when it returns: that
re-read (its `reread` a token) is charged to the return, spread over the drafter's `stretch`.
Acceptance starts from a prior (the profile's measurement on this target, else a default; for a
model drafter, what it kept in the process's answers so far where that is higher) and follows the
text as exponentially weighted counts. A model drafter has one per-token rate (the
model above), judged when it drafted, and drafts the k that pays best. A lookup's offer is
drafted whole or not at all and is judged by the chance that its first j tokens are all kept,
for every j (`Survival`: E = 1 + S(1) + ... + S(length)); every offer is scored whole against
the tokens committed after it, as they come. Suffix decoding drafts as far as its match
supports, so an offer's length is its own confidence (on the built-in 4-bit target's held-out
prompts 16-token offers were kept whole 70% of the time, 2-token ones 23%), which a per-token
rate blurs and a few steps of counts cannot second-guess. Lookups are asked in order of
preference, suffix decoding first (its offers were the better ones wherever both offered there),
and the first offer stands. Replayed on that target's greedy outputs, a per-token rate choosing
between both lookups' offers and cutting them short reached tau 1.405 where suffix decoding alone
reached 1.442 (docs/tuning.md, "auto").

Exact like every method: each step drafts with one drafter, whose q goes to the unchanged
verifier; the choice depends only on what was already committed.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, replace

import torch

from verispec.core.errors import VerispecError
from verispec.core.types import Proposal
from verispec.drafters.base import Drafter, DraftRequest

DECAY = 0.9  # weight of a lookup's survival seen one step earlier (a memory of about ten steps)
# ... of a model drafter's acceptance (about twenty steps): how often its drafts are kept barely
# follows the text step to step (EAGLE on the built-in 4-bit target: its first token kept 57% of
# the time after a step that kept one, 47% after a refusal), and with ten steps' memory its
# estimate wandered below what pays often enough to leave a third of the answer to plain decoding
MODEL_DECAY = 0.95
COST_DECAY = 0.5  # weight of a model drafter's slowdown seen one step earlier (a few steps)
# share of a model drafter's slowdown beyond 1, and of its acceptance's departure from the prior,
# kept at each step it sits out (halved in about 14 steps): a stretch of load on the machine, or of
# text it drafted badly, does not price it out for the rest of the answer (a few refusals in a row
# put EAGLE below plain decoding on the 4-bit target, where it then sat out 110 of 128 tokens)
RECOVERY = 0.95
PRIOR_WEIGHT = 1.0  # a lookup's prior counts as this many offers judged at each position
# a model drafter's prior counts as this many refusals (and the accepted tokens they imply): at 1,
# one refusal took EAGLE on the 4-bit target from its prior 0.39 to 0.24, priced out for the next
# fifteen steps, and an answer whose first few drafts were refused went mostly to plain decoding
MODEL_PRIOR_WEIGHT = 3.0
# ... in the acceptance learnt across a process's answers, which each unseeded answer starts from
LEARNT_WEIGHT = 3.0
MOST_PRIOR = 0.97  # a prior above this is taken as this: a few refusals then tell
LOOKUP_PRIOR = 0.5  # acceptance assumed for a lookup's drafts before any were judged
MODEL_PRIOR = 0.7  # ... for a model drafter's, where the profile measured none
# How much more a candidate's modelled rate must be than plain decoding's for auto to speculate:
# the profile's T(rows) move by a few percent between runs of one machine (docs/tuning.md), so a
# step modelled a hair above plain decoding is as likely a loss; declining it costs at most this
# share of such steps, and keeps auto from decoding slower than `ar` on text where nothing pays.
MARGIN = 0.03
# weight of the per-step overhead seen one step earlier (auto's `overhead`)
OVERHEAD_DECAY = 0.9
# A tree's level costs this many of a chain's drafted tokens (its nodes go through the drafter
# together): 1.7 against 1.3 ms a depth-2 step for EAGLE on the 4-bit target (docs/tuning.md).
TREE_LEVEL = 1.3
# A model drafter that sat out a stretch re-reads it when it is next chosen (one forward over the
# skipped tokens: a self-drafter's is a prefill through the whole model), a cost paid once a
# return and spread over the steps the return buys: the drafter's stretch, its mean run of
# consecutive steps chosen (this many before any run was seen; weighted to the latest runs by
# STRETCH_DECAY). Uncharged, a self-drafter on the built-in bfloat16 target was chosen for one or
# two steps at a time between EAGLE's and re-read the skipped text at each return: 0.68-0.73 s of
# drafting an answer against EAGLE's 0.18 s (docs/tuning.md).
STRETCH_PRIOR = 4.0
STRETCH_DECAY = 0.8
# A model drafter priced a little under the step chosen is tried now and then, or it is never
# judged on this text: on a held-out prompt of the built-in 4-bit target EAGLE's prior (0.39, from
# the profile's one paragraph) and a noisy T(2) priced it 4.5% under plain decoding at the first
# step, so it sat out all 115 steps, where EAGLE alone ran 1.25x `ar`; on the bfloat16 target a prior
# of 0.25 priced it under the int4 self-drafter for a whole run, 0.86x the best fixed method
# (docs/tuning.md). A model drafter within EXPLORE_BAND of the chosen step's rate (a lookup's, a
# model drafter's, plain decoding's) that has not drafted for EXPLORE_EVERY steps of this answer (nor
# ever, at its first chance) drafts its best k instead; each trial whose first token is refused
# doubles the wait for the next, and any of its drafts that keeps a token puts it back. A trial
# costs at most the band's share of a step: under 1% of the answer at these settings.
EXPLORE_BAND = 0.1
EXPLORE_EVERY = 16


@dataclass(frozen=True)
class DrafterCost:
    """What drafting costs with one drafter, and how often its drafts were accepted when it was
    measured (per token; None: it drafted too little to tell)."""

    per_step: float  # seconds per proposal, whatever its length
    per_token: float  # seconds per drafted token
    acceptance: float | None = None  # in the answer where it drafted best (auto's prior)
    pooled: float | None = None  # over all the answers it drafted in (verispec.profile)

    def seconds(self, k: float) -> float:
        return self.per_step + self.per_token * k


@dataclass(frozen=True)
class CostProfile:
    """What one target costs on one machine (verispec.profile measures and caches it)."""

    forward: tuple[float, ...]  # [rows]: seconds of one target forward over 1, 2, ... rows, cached context
    context: int  # tokens cached while `forward` was measured
    prefill_rate: float  # prompt tokens per second
    drafters: dict[str, DrafterCost]
    # how far the forward's repeated timings disagreed: the median over row counts of (most -
    # least) / median (verispec.profile: a busy machine's profile is not cached)
    noise: float = 0.0

    def forward_seconds(self, rows: int) -> float:
        """T(rows): measured up to len(forward) rows, extended linearly from the last two beyond.

        >>> CostProfile((1.0, 1.5), 300, 100.0, {}).forward_seconds(4)
        2.5
        """
        measured = self.forward
        if rows <= len(measured):
            return measured[rows - 1]
        slope = measured[-1] - measured[-2] if len(measured) > 1 else measured[-1]
        return measured[-1] + slope * (rows - len(measured))


@dataclass(frozen=True)
class Choice:
    """One step's decision: the candidate (None: plain decoding), its draft length, the expected
    rate; trial: drafted to judge a candidate priced under plain decoding (`explore`)."""

    method: str | None
    k: int
    tokens_per_second: float
    trial: bool = False


def expected_tokens(acceptance: float, k: int) -> float:
    """Tokens a step yields on average: the accepted drafts and the target's own token.

    >>> expected_tokens(0.5, 2)
    1.75
    >>> expected_tokens(1.0, 3)
    4.0
    """
    if acceptance >= 1.0:
        return float(k + 1)
    return (1.0 - acceptance ** (k + 1)) / (1.0 - acceptance)


def expected_by_length(acceptance: float | tuple[float, ...], k: int) -> float:
    """Tokens a step drafting k yields: by a per-token rate (expected_tokens), or by a survival
    curve (S(j): the chance the first j drafted tokens are all kept, j = 1, 2, ...).

    >>> expected_by_length(0.5, 2), expected_by_length((0.5, 0.25, 0.1), 2)
    (1.75, 1.75)
    """
    if isinstance(acceptance, tuple):
        return 1.0 + sum(acceptance[:k])
    return expected_tokens(acceptance, k)


def best_choice(profile: CostProfile, acceptance: dict[str, float | tuple[float, ...]],
                limits: dict[str, int], batch: int = 1, slowdown: dict[str, float] | None = None,
                whole: Collection[str] = (), pace: Callable[[int], float] | None = None,
                overhead: float = 0.0, trees: dict[str, int] | None = None,
                catchup: dict[str, float] | None = None, explore: Collection[str] = ()) -> Choice:
    """The candidate and draft length (1..limits[name]; exactly limits[name] for the names in
    `whole` and in `trees`) with the most expected tokens per second for each of `batch` sequences
    sharing the target pass; plain decoding when none beats it. acceptance: name -> a per-token
    rate or a survival curve (expected_by_length). slowdown: name -> how much longer its drafting
    has taken than the profile says (default 1); pace: rows -> how much longer the target's
    forward over that many rows has taken than the profile's T(rows) (default 1); overhead:
    seconds a step of the batch costs besides the forward and the drafting (verification,
    bookkeeping: paid once a token by plain decoding, once a step by a draft); trees: name -> the
    nodes of the tree it drafts to depth limits[name] (its step verifies 1 + nodes rows, and a
    level costs TREE_LEVEL drafted tokens; its rate is what its own trees kept a level); catchup:
    name -> seconds this step adds for re-reading what the drafter sat out (AutoDrafter spreads a
    return's re-read over the steps it buys). A candidate displaces plain decoding only where its
    rate beats plain decoding's by MARGIN; the best of `explore` (candidates owed a trial) other than
    the one chosen whose rate is within EXPLORE_BAND under the chosen one's (plain decoding's where
    none beats it) is drafted instead, as a trial.

    >>> profile = CostProfile((0.010, 0.011, 0.012, 0.013), 300, 1e4, {
    ...     "lookup": DrafterCost(0.0, 0.0), "model": DrafterCost(0.0, 0.008)})
    >>> choice = best_choice(profile, {"lookup": 0.9, "model": 0.9}, {"lookup": 3, "model": 3})
    >>> choice.method, choice.k, round(choice.tokens_per_second)
    ('lookup', 3, 265)
    >>> best_choice(profile, {"model": 0.5}, {"model": 3}).method is None
    True
    >>> best_choice(profile, {"model": 0.75}, {"model": 3}).method is None  # 92 tokens/s against 100
    True
    >>> trial = best_choice(profile, {"model": 0.75}, {"model": 3}, explore={"model"})
    >>> trial.method, trial.k, trial.trial
    ('model', 1, True)
    >>> rates = {"lookup": (0.15,), "model": 0.8}  # the lookup chosen (105 tokens/s), the model at 95
    >>> [best_choice(profile, rates, {"lookup": 1, "model": 3}, whole={"lookup"}, explore=owed).method
    ...  for owed in ((), {"model"})]
    ['lookup', 'model']
    """
    def forward(rows: int) -> float:
        return profile.forward_seconds(rows) * (1.0 if pace is None else pace(rows)) + overhead

    trees = trees or {}
    plain = Choice(None, 0, batch / forward(batch))
    best = replace(plain, tokens_per_second=plain.tokens_per_second * (1 + MARGIN))
    trials: list[Choice] = []  # every draft of a candidate owed a trial
    for name, limit in limits.items():
        cost = profile.drafters[name]
        for k in (limit,) if name in whole or name in trees else range(1, limit + 1):
            rows, drafted = (1 + trees[name], TREE_LEVEL * k) if name in trees else (k + 1, k)
            seconds = (forward(batch * rows) / batch + cost.seconds(drafted) * (slowdown or {}).get(name, 1.0)
                       + (catchup or {}).get(name, 0.0))
            rate = expected_by_length(acceptance[name], k) / seconds
            if rate > best.tokens_per_second:
                best = Choice(name, k, rate)
            if name in explore:
                trials.append(Choice(name, k, rate, trial=True))
    chosen = plain if best.method is None else best
    floor = chosen.tokens_per_second * (1 - EXPLORE_BAND)
    trial = max((choice for choice in trials if choice.method != chosen.method
                 and choice.tokens_per_second > floor), key=lambda choice: choice.tokens_per_second,
                default=None)
    return chosen if trial is None else trial


class Acceptance:
    """A candidate's per-token acceptance: exponentially weighted counts of accepted tokens and of
    refusals (the maximum-likelihood rate of a step that kept m of k is m / (m + [m < k])),
    starting from the prior as pseudo-counts (`weight` refusals) that fade like any observation
    (decay: the weight of a count one step older; 1: an average of everything seen)."""

    def __init__(self, prior: float, decay: float = MODEL_DECAY, weight: float = MODEL_PRIOR_WEIGHT) -> None:
        prior = min(max(prior, 0.01), MOST_PRIOR)
        self.decay = decay
        self.prior = (weight * prior / (1.0 - prior), weight)  # (kept, refused)
        self.kept, self.refused = self.prior
        # the share of the counts' distance from the prior's closed at a step sat out: halved by
        # each return after plain steps whose first token is refused, where the prior says that
        # is the rarer outcome (above 0.5), so that a drafter that fails again and again is tried
        # at ever longer intervals (with a prior of 0.9, a few times in an answer instead of every
        # other step); back to 1 - RECOVERY at a return that keeps a token. (Halving after any
        # refused return cost EAGLE, kept 39% of the time, 0.1 of its tau on the 4-bit target.)
        self.recovery = 1.0 - RECOVERY
        self.rested = False

    def observe(self, judged: int, kept: int) -> None:
        """`kept` of the `judged` leading draft tokens matched (judged > kept: one was refused)."""
        if self.rested:
            if kept:
                self.recovery = 1.0 - RECOVERY
            elif self.prior[0] > self.prior[1]:  # the prior above 0.5: a refusal is the rarer outcome
                self.recovery /= 2
            self.rested = False
        self.kept = self.decay * self.kept + kept
        self.refused = self.decay * self.refused + (1.0 if kept < judged else 0.0)

    def rest(self, priced_out: bool, tokens: int = 1) -> None:
        """A step without drafting, that committed `tokens`: the counts drift back towards the
        prior's, by the text that went by (a stretch of another drafter's 8-token steps is as
        long as 8 plain steps: counted by steps, the int4 self-drafter kept most of an answer on
        the bfloat16 target after two of EAGLE's drafts were refused). priced_out: the step was a
        plain one (no candidate paid), so the next draft is a return to be judged; a step another
        drafter took says nothing against this one."""
        share = 1.0 - (1.0 - self.recovery) ** tokens
        self.kept += share * (self.prior[0] - self.kept)
        self.refused += share * (self.prior[1] - self.refused)
        self.rested = self.rested or priced_out

    @property
    def rate(self) -> float:
        return self.kept / (self.kept + self.refused)


class Survival:
    """A lookup's chance that an offer's first j tokens are all kept, for j = 1..depth: at each
    position exponentially weighted counts of the drafts judged there and of those kept through
    it, starting from a geometric prior (prior^j, as pseudo-counts that fade like any
    observation)."""

    def __init__(self, prior: float, depth: int) -> None:
        prior = min(max(prior, 0.01), MOST_PRIOR)
        self.kept = [PRIOR_WEIGHT * prior ** j for j in range(1, depth + 1)]
        self.seen = [PRIOR_WEIGHT] * depth

    def observe(self, length: int, kept: int, counted: int = 0) -> None:
        """Positions counted + 1 .. length of a draft whose first `kept` tokens matched the text
        (every position after them fails); `counted`: its positions observed already (a draft is
        observed position by position as the text decides them)."""
        for j in range(counted, min(length, len(self.seen))):
            self.seen[j] = DECAY * self.seen[j] + 1.0
            self.kept[j] = DECAY * self.kept[j] + (1.0 if j < kept else 0.0)

    @property
    def curve(self) -> tuple[float, ...]:
        """S(1), S(2), ...: never rising (a longer prefix cannot be kept more often)."""
        curve, least = [], 1.0
        for kept, seen in zip(self.kept, self.seen):
            least = min(least, kept / seen)
            curve.append(least)
        return tuple(curve)


class Pace:
    """The target's forward as this machine runs it now, against the profile: per row count, the
    exponentially weighted ratio of a forward's seconds to the profile's T(rows). A row count not
    seen yet takes the ratio of the nearest one seen (the largest below, else the smallest above),
    so that the profile's shape (T(2) / T(1), ...) stands until a forward of that size says
    otherwise; with none seen, 1. (The profile is timed once, outside decoding, and a run's
    forwards need not agree: on the built-in 4-bit target, at the end of six runs whose profiles
    read T(2) / T(1) = 1.01-1.18, auto's own two-row forwards cost 0.87-1.24 of its one-row ones;
    docs/tuning.md.)"""

    def __init__(self) -> None:
        self.counts: dict[int, tuple[float, float]] = {}  # rows -> (weighted ratios, weight)

    def __call__(self, rows: int) -> float:
        if rows in self.counts:
            total, weight = self.counts[rows]
            return total / weight
        below = [seen for seen in self.counts if seen < rows]
        above = [seen for seen in self.counts if seen > rows]
        if below or above:
            return self(max(below) if below else min(above))
        return 1.0

    def observe(self, rows: int, ratio: float) -> None:
        """A forward over `rows` took `ratio` times the profile's T(rows); one reading moves the
        estimate at most by a factor of two (a pause of the process is not the machine's pace)."""
        now = self(rows)
        total, weight = self.counts.get(rows, (now * PRIOR_WEIGHT, PRIOR_WEIGHT))
        ratio = min(max(ratio, now / 2), now * 2)
        self.counts[rows] = (DECAY * total + ratio, DECAY * weight + 1.0)


def _leading_matches(draft: list[int], committed: list[int]) -> int:
    """How many of the draft's first tokens the committed tokens repeat."""
    count = 0
    for drafted, kept in zip(draft, committed):
        if drafted != kept:
            break
        count += 1
    return count


class AutoDrafter(Drafter):
    """Chooses every step among `lookups` (name -> a drafter that may propose nothing) and
    `models` (name -> a drafter that always can), each drafting at most limits[name] tokens, by
    `profile`; each Proposal's `choice` says (name, k), (`plain`, 0) for a plain step. trees:
    name -> the nodes of the tree that model drafter drafts (built so), always to depth
    limits[name]."""

    def __init__(self, profile: CostProfile, lookups: dict[str, Drafter], models: dict[str, Drafter],
                 limits: dict[str, int], plain: str, trees: dict[str, int] | None = None) -> None:
        candidates = {**lookups, **models}
        missing = [name for name in candidates if name not in profile.drafters]
        if missing:
            raise VerispecError(f"the cost profile has no figures for {', '.join(missing)}")
        self.profile, self.lookups, self.models, self.limits = profile, lookups, models, limits
        self.plain, self.trees = plain, trees or {}
        self.adopts_prefill = any(drafter.adopts_prefill for drafter in candidates.values())
        # A drafter that reads the target's hidden states (EAGLE) gets them every step, chosen or
        # not, and catches up on the stretches it sat out when it is next chosen.
        readers = {drafter.hidden_layers for drafter in candidates.values() if drafter.needs_hidden}
        if len(readers) > 1:
            raise VerispecError("auto's candidates read different layers' hidden states")
        self.needs_hidden = bool(readers)
        self.hidden_layers = next(iter(readers), ())
        self.priors = {name: LOOKUP_PRIOR if name in lookups else MODEL_PRIOR for name in candidates}
        # name -> drafting seconds as taken / as the profile predicts them, weighted to the latest
        # steps in the flow of drafting (not those that catch up on a stretch the drafter sat out,
        # one block of rows: see commit); kept across sequences: it is this machine's.
        self.slowdown = {name: 1.0 for name in models}
        # name -> seconds a model drafter takes to re-read a token it sat out, measured at its
        # returns; until one is, a drafted token's cost times the target's per row in its widest
        # profiled forward against one row's (a re-read is one forward over the stretch: on the
        # built-in bfloat16 target that ratio read 0.21, and returns measured EAGLE's re-read at
        # 0.20-0.25 ms a token against 1.08 drafted, the int4 self-drafter's at 3.8 against 14.5);
        # and its stretch (STRETCH_PRIOR); both kept across sequences
        widest = len(profile.forward)
        block = profile.forward_seconds(widest) / (widest * profile.forward_seconds(1))
        self.reread = {name: profile.drafters[name].per_token * block for name in models}
        self.stretch = {name: STRETCH_PRIOR for name in models}
        self.pace = Pace()  # the target's forward against the profile's; kept across sequences too
        self.awaiting = False  # auto proposed this step and its forward is not counted yet
        # Seconds a step costs besides the target's forward and a model drafter's drafting (the
        # verification, the engine's and auto's own bookkeeping, a lookup): weighted to the
        # latest steps, kept across sequences. Paid once a token by plain decoding and once a
        # step by a draft, it is what makes drafting pay beyond the forward's arithmetic: on the
        # built-in 4-bit target 0.7-0.9 ms a step against a 6 ms forward.
        self.overhead = 0.0
        self.step_started: float | None = None  # when this sequence's last step was proposed
        self.step_forward = 0.0  # that step's target forward, seconds (observe_forward)
        for name in candidates:
            measured = profile.drafters[name].acceptance
            if measured is not None:
                self.priors[name] = measured
        # name -> a model drafter's acceptance over every answer so far, from the profile's: an
        # unseeded answer starts from it where it is the higher (the profile measured one
        # paragraph: EAGLE's 0.39 on the 4-bit target, where the held-out prompts' answers kept
        # 0.52), from the profile's otherwise: a few unlucky answers must not price a drafter out
        # for good (it would draft no more, and the figure could not recover)
        self.learnt = {name: Acceptance(self.priors[name], 1.0, LEARNT_WEIGHT) for name in models}
        # the model drafter chosen last, its steps in a row, whether the run began as a trial
        self.run: tuple[str | None, int, bool] = (None, 0, False)
        self.trials = [0, 0]  # trials drafted (explore), and those whose first token was kept: all sequences
        self.reset()

    def reset(self) -> None:
        for drafter in (*self.lookups.values(), *self.models.values()):
            drafter.reset()
        self.acceptance: dict[str, Acceptance] = {}  # at the first step (propose)
        self.survival = {name: Survival(self.priors[name], self.limits[name]) for name in self.lookups}
        self.asked: dict[str, Drafter] = {}  # drafters that proposed this step (commit follows)
        self.chosen: str | None = None  # None: a plain step
        self.drafted = 0  # tokens the chosen drafter proposed this step
        self.spent = 0.0  # seconds its proposal took
        # name -> the context's length when the model drafter last drafted (None: not yet in this
        # sequence), and the tokens this step's proposal re-read of a stretch it sat out (0: none)
        self.fed: dict[str, int | None] = {name: None for name in self.models}
        self.caught_up = 0
        # name -> (steps since the model drafter last drafted in this sequence, steps a trial
        # waits for: EXPLORE); owed at its first plain step
        self.idle = {name: (EXPLORE_EVERY, EXPLORE_EVERY) for name in self.models}
        self.trial = False  # this step drafts as a trial
        self._end_run()
        self.timed = True  # whether this step's drafting time counts (not in a seeded sequence)
        self.step_started = None  # a sequence's first step follows its prefill: no overhead read
        # lookups' offers not wholly judged yet: (name, where the draft starts in the context,
        # draft, how many of its positions are counted already)
        self.pending: list[tuple[str, int, list[int], int]] = []

    def _behind(self, name: str, context: int) -> int:
        """Tokens model drafter `name` would re-read if chosen now beyond what a step leaves it
        (at most its k accepted and the bonus token): 0 where it is up to date. Its first
        proposal in a sequence reads the prompt, or none of it where it adopts the prefill."""
        fed = self.fed[name]
        if fed is None:
            fed = context if self.models[name].adopts_prefill else 0
        return context - fed if context - fed > self.limits[name] + 1 else 0

    def _end_run(self) -> None:
        """The chosen model drafter's run of steps ended: its stretch learns the run's length, but
        from a trial that was all the run (a return chosen to judge the drafter, not for what it
        buys: counted, refused trials shortened EAGLE's stretch and priced its chosen returns out)."""
        name, steps, trial = self.run
        if name is not None and not (trial and steps == 1):
            self.stretch[name] = STRETCH_DECAY * self.stretch[name] + (1 - STRETCH_DECAY) * steps
        self.run = (None, 0, False)

    def adopt_prefill(self, target) -> None:
        for drafter in (*self.lookups.values(), *self.models.values()):
            if drafter.adopts_prefill:
                drafter.adopt_prefill(target)

    def _judge(self, tokens: torch.Tensor) -> None:
        """Count the positions of pending offers that the committed `tokens` [context] have
        decided since: a refusal decides all the rest; a tail not committed yet waits. (Counted
        only once covered whole, a declined long offer taught nothing while plain steps covered
        it one token at a time, and was declined again at every step.)"""
        waiting = []
        for name, start, draft, counted in self.pending:
            text = tokens[start:start + len(draft)].tolist()
            kept = _leading_matches(draft, text)
            decided = len(draft) if kept < len(text) or len(text) == len(draft) else kept
            self.survival[name].observe(decided, kept, counted)
            if decided < len(draft):
                waiting.append((name, start, draft, decided))
        self.pending = waiting

    def propose(self, request: DraftRequest) -> Proposal:
        self._time_step()
        self._judge(request.tokens)
        context = request.tokens.shape[0]
        if not self.acceptance:  # a seeded answer starts from the profile alone, as it is priced
            self.acceptance = {name: Acceptance(self.priors[name] if request.seeded
                                                else max(learnt.rate, self.priors[name]))
                               for name, learnt in self.learnt.items()}
            # a drafter that adopts the prefill holds the prompt, whenever it is first chosen
            self.fed |= {name: context for name, model in self.models.items() if model.adopts_prefill}
        self.asked = {}
        drafts: dict[str, Proposal] = {}
        for name, lookup in self.lookups.items():  # in order of preference: the first offer stands
            capped = request if request.k <= self.limits[name] else replace(request, k=self.limits[name])
            proposal = lookup.propose(capped)
            self.asked[name] = lookup
            if len(proposal):
                drafts[name] = proposal
                break
        limits = {name: len(proposal) for name, proposal in drafts.items()}
        limits |= {name: min(request.k, self.limits[name]) for name in self.models}
        rates: dict[str, float | tuple[float, ...]] = {name: self.survival[name].curve for name in drafts}
        rates |= {name: self.acceptance[name].rate for name in self.models}
        # a seeded sequence is priced by the profile alone: its output must not follow the load
        slowdown, pace, overhead = (None, None, 0.0) if request.seeded else (self.slowdown, self.pace,
                                                                             self.overhead)
        # a return's re-read, spread over its stretch (not the prompt a drafter reads first: a
        # cost any use of it pays once, and charged, would keep it out while the text it must
        # read grows)
        catchup = None if request.seeded else {
            name: self.reread[name] * self._behind(name, context) / self.stretch[name]
            for name in self.models if self.fed[name] is not None}
        owed = {name for name, (idle, wait) in self.idle.items() if idle >= wait}
        choice = best_choice(self.profile, rates, limits, request.batch, slowdown, drafts, pace, overhead,
                             self.trees, catchup, owed)
        self.trial = choice.trial
        self.awaiting = True
        self.timed = not request.seeded
        self.chosen = choice.method
        self.pending += [(name, context, proposal.tokens.tolist(), 0) for name, proposal in drafts.items()]
        self.spent = 0.0
        if choice.method in drafts:
            proposal = drafts[choice.method]
        elif choice.method in self.models:
            model = self.models[choice.method]
            self.asked[choice.method] = model
            self.caught_up = self._behind(choice.method, context)
            self.fed[choice.method] = context
            started = time.perf_counter()
            proposal = model.propose(replace(request, k=choice.k))
            self.spent = time.perf_counter() - started
        else:
            proposal = Proposal(request.tokens[:0])
        self.drafted = proposal.depth  # the positions judged (a tree's: each level once)
        return replace(proposal, choice=(choice.method or self.plain, choice.k))

    def observe_forward(self, rows: int, seconds: float) -> None:
        if self.awaiting:  # once a step, and only for a step auto proposed (not a wrapper's)
            self.awaiting = False
            self.pace.observe(rows, seconds / self.profile.forward_seconds(rows))
            self.step_forward = seconds
        else:  # a step a wrapper drafted itself: the next step's period spans two forwards
            self.step_started = None

    def _time_step(self) -> None:
        """At a step's start: what the last step cost besides its forward and a model drafter's
        drafting, counted at most as one forward (a pause of the process is not overhead)."""
        now = time.perf_counter()
        if self.step_started is not None and self.timed and not self.awaiting:
            taken = now - self.step_started - self.step_forward - self.spent
            self.overhead = (OVERHEAD_DECAY * self.overhead
                             + (1 - OVERHEAD_DECAY) * min(max(taken, 0.0), self.step_forward))
        self.step_started = now

    def commit(self, num_accepted: int) -> None:
        started = time.perf_counter()
        for name, drafter in self.asked.items():
            drafter.commit(num_accepted if name == self.chosen else 0)
        if self.chosen in self.models:
            self.acceptance[self.chosen].observe(self.drafted, num_accepted)
            self.learnt[self.chosen].observe(self.drafted, num_accepted)
            # a refused trial doubles the wait for the next; any draft that keeps a token puts it back
            wait = self.idle[self.chosen][1]
            if num_accepted:
                wait = EXPLORE_EVERY
            elif self.trial:
                wait *= 2
            if self.trial:
                self.trials[0] += 1
                self.trials[1] += bool(num_accepted)
            self.idle[self.chosen] = (0, wait)
        for name, (idle, wait) in self.idle.items():
            if name != self.chosen:
                self.idle[name] = (idle + 1, wait)
        # A step that caught up on a stretch the drafter sat out is no measure of its pace (counted,
        # it would price the drafter out) but of its re-reading: what it took beyond the drafting
        # its pace predicts, per token re-read.
        if self.chosen in self.models and self.drafted and self.timed:
            taken = self.spent + time.perf_counter() - started
            per_level = TREE_LEVEL if self.chosen in self.trees else 1.0  # drafted tokens' worth
            predicted = self.profile.drafters[self.chosen].seconds(per_level * self.drafted)
            if self.caught_up:
                reread = max(taken - predicted * self.slowdown[self.chosen], 0.0) / self.caught_up
                self.reread[self.chosen] = COST_DECAY * self.reread[self.chosen] + (1 - COST_DECAY) * reread
            else:
                self.slowdown[self.chosen] = (COST_DECAY * self.slowdown[self.chosen]
                                              + (1 - COST_DECAY) * taken / max(predicted, 1e-6))
        if self.chosen != self.run[0]:
            self._end_run()
        if self.chosen in self.models:
            self.run = (self.chosen, self.run[1] + 1, self.run[2] or (self.run[1] == 0 and self.trial))
        for name in self.models:  # the others drift back to the profile's figures
            if name != self.chosen:
                self.slowdown[name] = 1 + (self.slowdown[name] - 1) * RECOVERY
                self.acceptance[name].rest(priced_out=self.chosen is None, tokens=num_accepted + 1)

    def describe(self) -> str:
        names = ", ".join([*self.lookups, *self.models])
        return f"auto: chooses among {names} and plain decoding by the cost profile"
