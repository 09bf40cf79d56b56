"""End-to-end sampling exactness of an engine: the tokens it emits follow the target's law; and
the statistics every sampling test shares.

`exact_marginals` enumerates every path of the target's first n sampled tokens (after the same
temperature / top-k / top-p warping the engine applies) and sums their probabilities per position:
the exact marginal of each emitted position. `sample_runs` draws many seeded samples of one prompt
through an engine (batched: the samples share the prefill, no load cap, so every row drafts) and
counts the tokens emitted at each position, with what the drafter did. `assert_follows` compares
each position's empirical law with the exact one by total variation.

The test (derived in docs/testing.md, "Sample sizes with power"): a law over K categories (the
truth's support, plus one category lumping every token outside it, which the truth gives 0),
n i.i.d. draws, statistic T = TV(empirical, truth) = max over subsets A of (empirical(A) - truth(A)).
- False alarm: Hoeffding for each of the 2^K - 2 non-trivial subsets and a union bound give
  P(T >= t) <= (2^K - 2) exp(-2 n t^2); `tv_threshold` solves it for t at delta. A test checking m
  laws uses delta = FALSE_ALARM / m: a correct engine fails it with probability <= 1e-4.
- Power: if the engine's law is at TV s from the truth, its set A* = {x: law(x) > truth(x)} has
  law(A*) - truth(A*) = s, and T < t needs the empirical(A*) to fall s - t below law(A*): by
  Hoeffding, probability <= exp(-2 n (s - t)^2). `samples_for_power` is the least n making that
  <= MISS at s = SKEW: a skew of TV 0.05 at any checked law fails the test with probability >= 0.99.
The sample size is derived from the support before sampling (`runs_for`) and asserted after. Each
end-to-end test runs twice (POWER): against TV 0.1 in the default suite, against 0.05 marked slow.

A test must prove it exercised what it names: `Sampled.check_drafting` asserts that drafts were
made at every position checked and that some were accepted and some rejected.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest
import torch

from verispec.core.grammar import Constraint
from verispec.core.sampling import warp_probs
from verispec.core.stopping import StoppingRules
from verispec.core.types import GenerationResult, SamplingParams
from verispec.decoding.engine import SpeculativeEngine
from verispec.decoding.sequence import SequenceSpec

FALSE_ALARM = 1e-4  # per test: the probability that an exact engine fails it
SKEW = 0.05  # a law this far (total variation) from the truth ...
MISS = 0.01  # ... passes a check with probability at most this (power 0.99)
FAST_SKEW = 0.1  # the default suite's variants: power 0.99 against this skew, a quarter the samples
# Every end-to-end sampling test runs at both: `fast` in the default suite, `full` (the SKEW the
# issue asks for) marked slow and full_power. .ci/run runs the full power of the core paths only
# (a chain, a token tree, staged drafting, auto): the rest took ~18 of a CI run's 90 minutes on
# the AVX2 EPYC (2026-11-30); `pytest -m full_power` runs them all, after a change to sampling.
FULL = [pytest.mark.slow, pytest.mark.full_power]
POWER = [pytest.param(FAST_SKEW, id="fast"), pytest.param(SKEW, id="full", marks=FULL)]


def tv(a: torch.Tensor, b: torch.Tensor) -> float:
    """Total variation distance between two distributions over the same categories ([K] each)."""
    return 0.5 * (a.double() - b.double()).abs().sum().item()


def _log_subsets(categories: int) -> float:
    """ln(2^K - 2): the non-trivial subsets a TV maximises over (K >= 2)."""
    return math.log(2 ** max(categories, 2) - 2)


def tv_threshold(n: int, categories: int, delta: float = FALSE_ALARM) -> float:
    """t with P(TV(empirical of n i.i.d. draws, truth) >= t) <= delta over `categories` categories:
    sqrt((ln(2^K - 2) + ln(1/delta)) / (2 n))."""
    return math.sqrt((_log_subsets(categories) + math.log(1 / delta)) / (2 * n))


def samples_for_power(categories: int, delta: float = FALSE_ALARM, skew: float = SKEW,
                      miss: float = MISS) -> int:
    """The least n at which a law at TV `skew` from the truth passes the check (TV below
    tv_threshold(n, categories, delta)) with probability <= miss:
    n = (sqrt(ln(2^K - 2) + ln(1/delta)) + sqrt(ln(1/miss)))^2 / (2 skew^2)."""
    root = math.sqrt(_log_subsets(categories) + math.log(1 / delta)) + math.sqrt(math.log(1 / miss))
    return math.ceil(root ** 2 / (2 * skew ** 2))


def lump(empirical: torch.Tensor, truth: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Both laws [V] restricted to the truth's support plus one category for everything outside it
    (which the truth gives 0): K = support + 1 categories, whatever the vocabulary."""
    support = truth > 0
    return (torch.cat([empirical[support], empirical[~support].sum()[None]]).double(),
            torch.cat([truth[support], truth.new_zeros(1)]).double())


def check_laws(laws: list[tuple[str, torch.Tensor, torch.Tensor]], n: int, skew: float = SKEW) -> list[str]:
    """What is wrong with `laws` ((label, empirical [V], truth [V]) over n draws each), checked
    together at FALSE_ALARM: a TV over its threshold, or n too small for power against `skew`."""
    delta = FALSE_ALARM / len(laws)
    problems = []
    for label, empirical, truth in laws:
        seen, exact = lump(empirical, truth)
        categories = exact.numel()
        needed = samples_for_power(categories, delta, skew)
        if n < needed:
            problems.append(f"{label}: {n} samples give no power (need {needed})")
        distance, threshold = tv(seen, exact), tv_threshold(n, categories, delta)
        if distance >= threshold:
            problems.append(f"{label}: TV {distance:.4f} >= {threshold:.4f} (n {n}, K {categories})")
    return problems


def assert_laws(laws: list[tuple[str, torch.Tensor, torch.Tensor]], n: int, skew: float = SKEW) -> None:
    problems = check_laws(laws, n, skew)
    assert not problems, problems


def runs_for(exact: torch.Tensor, skew: float = SKEW) -> int:
    """Samples a test needs so that each of its laws (the rows of exact [m, V]) has power 0.99
    against `skew`."""
    return max(samples_for_power(int((row > 0).sum()) + 1, FALSE_ALARM / exact.shape[0], skew)
               for row in exact)


@torch.no_grad()
def exact_marginals(model: torch.nn.Module, prompt: list[int], n: int,
                    sampling: SamplingParams) -> torch.Tensor:
    """The target's exact distribution of each of its next n sampled tokens: [n, vocab] float64.

    Every path with non-zero probability is scored, one batched forward per position (vocabulary
    V: at most V^(n-1) paths in the last forward, so keep V and n small)."""
    paths = torch.tensor([prompt])  # [P, len]
    weights = torch.ones(1, dtype=torch.float64)  # [P]
    out = []
    for position in range(n):
        probs = warp_probs(model(paths).logits[:, -1], sampling).double()  # [P, V]
        joint = weights[:, None] * probs  # [P, V]
        out.append(joint.sum(0))
        if position == n - 1:
            break
        path_index, token = joint.nonzero(as_tuple=True)
        paths = torch.cat([paths[path_index], token[:, None]], dim=1)
        weights = joint[path_index, token]
    return torch.stack(out)


@dataclass
class Sampled:
    """What `sample_runs` saw: counts [n, vocab] of the token emitted at each position, and the
    drafter's work summed over every step of every sample."""

    counts: torch.Tensor  # [n, vocab] float64
    runs: int
    drafted_by_position: list[int]  # steps that drafted position i (a tree: its depth)
    kept_by_position: list[int]  # steps whose draft was accepted up to position i
    steps_drafting: int  # steps with a draft
    steps_rejecting: int  # steps where the verifier refused part of the draft
    steps_branching: int = 0  # steps whose draft was a tree (not a chain)
    results: list[GenerationResult] = field(default_factory=list)  # every sample's, in seed order

    def check_drafting(self, positions: int = 1) -> None:
        """Drafts were made at the first `positions` positions; some steps kept their whole
        draft's depth, others refused part of it (both sides of the verifier ran)."""
        assert len(self.drafted_by_position) >= positions, self.drafted_by_position
        assert min(self.drafted_by_position[:positions]) > 0.05 * self.runs, self.drafted_by_position
        assert 0 < self.steps_rejecting < self.steps_drafting, (self.steps_rejecting, self.steps_drafting)


def sample_runs(engine: SpeculativeEngine, prompt: list[int], n: int, sampling: SamplingParams,
                runs: int, per_batch: int = 500, seed: int = 0, constraint: Constraint | None = None,
                prediction: list[int] | None = None, before_batch: Callable[[], None] | None = None
                ) -> Sampled:
    """`runs` samples of n tokens of `prompt` through `engine` (batches of per_batch samples of
    one prompt; sample i seeded with seed + i), each under its own copy of `constraint` if given,
    with `prediction` (a predicted output) if given; `before_batch` is called before each batch
    (suffix: empty the outputs the last batch left, or later batches draft from their counts).

    On one thread: the tiny models gain nothing from a second, and on a machine shared with
    other jobs two threads contending for the cores made the same run up to 20 times slower."""
    vocab = engine.vocab_size
    counts = torch.zeros(n, vocab, dtype=torch.float64)
    drafted: list[int] = []
    kept: list[int] = []
    drafting = rejecting = branching = 0
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        results = []
        for start in range(0, runs, per_batch):
            if before_batch is not None:
                before_batch()
            results += engine.generate_batch(
                [SequenceSpec(prompt, StoppingRules.build(n), sampling, seed + start, prediction=prediction,
                              constraint=None if constraint is None else constraint.copy())],
                sequences=min(per_batch, runs - start))
    finally:
        torch.set_num_threads(threads)
    for result in results:
        counts[torch.arange(n), torch.tensor(result.token_ids)] += 1
        for step in result.steps:
            depth = step.draft_depth
            drafted.extend([0] * (depth - len(drafted)))
            kept.extend([0] * (depth - len(kept)))
            for i in range(depth):
                drafted[i] += 1
                kept[i] += i < step.num_accepted
            drafting += depth > 0
            rejecting += depth > 0 and step.num_accepted < depth
            branching += step.tree is not None
    return Sampled(counts, runs, drafted, kept, drafting, rejecting, branching, results)


def assert_follows(sampled: Sampled, exact: torch.Tensor, label: str, skew: float = SKEW) -> None:
    """Every position's empirical law against the exact one [n, vocab], checked together, with
    enough samples for power against `skew`."""
    assert_laws([(f"{label} position {i + 1}", sampled.counts[i] / sampled.runs, exact[i])
                 for i in range(exact.shape[0])], sampled.runs, skew)
