"""End-to-end sampling exactness of an engine: the tokens it emits follow the target's law.

`exact_marginals` enumerates every path of the target's first n sampled tokens (after the same
temperature / top-k / top-p warping the engine applies) and sums their probabilities per position:
the exact marginal of each emitted position. `sample_runs` draws many seeded samples of one prompt
through an engine (batched: the samples share the prefill, no load cap, so every row drafts) and
counts the tokens emitted at each position, with what the drafter did. `assert_follows` compares
each position's empirical distribution with the exact one by total variation against the
Bretagnolle-Huber-Carol bound for the sample size (tests/test_rejection_distribution.tv_bound,
false alarm 1e-6 per check); tokens outside the target's support are lumped into one category
that the truth gives 0, so the bound counts the support, not the vocabulary.

A test must prove it exercised what it names: `Sampled.check_drafting` asserts that drafts were
made at every position checked and that some were accepted and some rejected.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tests.test_rejection_distribution import tv, tv_bound
from verispec.core.grammar import Constraint
from verispec.core.sampling import warp_probs
from verispec.core.stopping import StoppingRules
from verispec.core.types import SamplingParams
from verispec.decoding.engine import SequenceSpec, SpeculativeEngine


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
    steps_drafting: int  # steps with a draft
    steps_rejecting: int  # steps where the verifier refused part of the draft

    def check_drafting(self, positions: int = 1) -> None:
        """Drafts were made at the first `positions` positions; some steps kept their whole
        draft's depth, others refused part of it (both sides of the verifier ran)."""
        assert len(self.drafted_by_position) >= positions, self.drafted_by_position
        assert min(self.drafted_by_position[:positions]) > 0.05 * self.runs, self.drafted_by_position
        assert 0 < self.steps_rejecting < self.steps_drafting, (self.steps_rejecting, self.steps_drafting)


def sample_runs(engine: SpeculativeEngine, prompt: list[int], n: int, sampling: SamplingParams,
                runs: int, per_batch: int = 500, seed: int = 0, constraint: Constraint | None = None
                ) -> Sampled:
    """`runs` samples of n tokens of `prompt` through `engine` (batches of per_batch samples of
    one prompt; sample i seeded with seed + i), each under its own copy of `constraint` if given.

    On one thread: the tiny models gain nothing from a second, and on a machine shared with
    other jobs two threads contending for the cores made the same run up to 20 times slower."""
    vocab = engine.vocab_size
    counts = torch.zeros(n, vocab, dtype=torch.float64)
    drafted: list[int] = []
    drafting = rejecting = 0
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        results = [result for start in range(0, runs, per_batch)
                   for result in engine.generate_batch(
                       [SequenceSpec(prompt, StoppingRules.build(n), sampling, seed + start,
                                     constraint=None if constraint is None else constraint.copy())],
                       samples=min(per_batch, runs - start))]
    finally:
        torch.set_num_threads(threads)
    for result in results:
        counts[torch.arange(n), torch.tensor(result.token_ids)] += 1
        for step in result.steps:
            depth = step.draft_depth
            drafted.extend([0] * (depth - len(drafted)))
            for i in range(depth):
                drafted[i] += 1
            drafting += depth > 0
            rejecting += depth > 0 and step.num_accepted < depth
    return Sampled(counts, runs, drafted, drafting, rejecting)


def distances(sampled: Sampled, exact: torch.Tensor) -> list[tuple[float, float]]:
    """(TV, bound) per position: the empirical law against exact [n, vocab], tokens outside the
    exact support lumped into one category."""
    out = []
    for position in range(exact.shape[0]):
        support = exact[position] > 0
        empirical = sampled.counts[position] / sampled.runs
        lumped = torch.cat([empirical[support], empirical[~support].sum()[None]])
        truth = torch.cat([exact[position][support], torch.zeros(1, dtype=torch.float64)])
        out.append((tv(lumped, truth), tv_bound(sampled.runs, int(support.sum()) + 1)))
    return out


def assert_follows(sampled: Sampled, exact: torch.Tensor, label: str) -> None:
    """Every position's empirical law within the sample-size bound of the exact one."""
    for position, (distance, bound) in enumerate(distances(sampled, exact)):
        assert distance <= bound, f"{label} position {position + 1}: TV {distance:.4f} > {bound:.4f}"
