"""Statistical losslessness of multi-candidate (tree) speculative sampling, `tree_rejection_sample`.

A two-level tree: m candidates for the first token, each with c candidates for the second. The
target is a known two-step model: p0 for the first token, table[t1] for the second. For every trial
the verifier emits a path and a next token; (t1, t2) are the first two emitted tokens, where a step
that emits only one token is completed by one plain target sample t2 ~ table[t1] (what the next
decoding step would do). Exactness means (t1, t2) ~ p0(t1) * table[t1](t2). The check is the total
variation between the empirical and the exact joint (and the t1 marginal), both checked together at
false alarm 1e-4 with the sample size that gives power 0.99 against a skew of TV 0.05
(tests/distribution.py).

Regimes: candidates drawn i.i.d. from q (with replacement); drawn from q without replacement (each
later sibling's q excludes the earlier ones); deterministic top-m (q one-hot, draft_probs None);
draft support disjoint from the target's. The test can fail: with the residual update between
siblings skipped (a later sibling tried against the original p), the first token's distribution
is biased towards the candidates, and the same TV check flags it.
"""

from __future__ import annotations

import pytest
import torch

import verispec.verifiers.tree as tree_verifier
from tests.distribution import FALSE_ALARM, FAST_SKEW, POWER, check_laws, samples_for_power
from tests.test_rejection_distribution import normalize
from verispec.core.sampling import sample
from verispec.verifiers.tree import tree_rejection_sample

V = 6


def trials(skew: float) -> int:
    """Trials for power against `skew`: the joint of two tokens has up to V * V + 1 categories
    (the lumped outside included), two laws are checked (13150 at 0.05, 3288 at 0.1; the bug's TV
    is about 0.2)."""
    return samples_for_power(V * V + 1, FALSE_ALARM / 2, skew)
P0 = torch.tensor([0.4, 0.3, 0.15, 0.08, 0.05, 0.02])
TABLE = normalize(torch.rand(V, V, generator=torch.Generator().manual_seed(3)) ** 2)  # [V, V]
Q0 = torch.tensor([0.1, 0.35, 0.3, 0.05, 0.15, 0.05])
QTABLE = normalize(torch.rand(V, V, generator=torch.Generator().manual_seed(4)))  # [V, V]
DISJOINT_P0 = torch.tensor([0.5, 0.3, 0.2, 0.0, 0.0, 0.0])
DISJOINT_Q0 = torch.tensor([0.0, 0.0, 0.0, 0.2, 0.3, 0.5])


def draw(q: torch.Tensor, count: int, how: str,
         gen: torch.Generator) -> tuple[list[int], list[torch.Tensor] | None]:
    """`count` candidate tokens from q [V] and the distribution each was drawn from."""
    if how == "deterministic":
        return torch.topk(q, count).indices.tolist(), None
    tokens, rows = [], []
    left = q.clone()
    for _ in range(count):
        rows.append(left.clone())
        token = int(sample(left, gen))
        tokens.append(token)
        if how == "without_replacement":
            left[token] = 0
            left = left / left.sum()
    return tokens, rows


def one_trial(p0: torch.Tensor, q0: torch.Tensor, how: str, m: int, c: int,
              gen: torch.Generator) -> tuple[int, int]:
    """Build a two-level tree, verify it, return the first two emitted tokens."""
    tokens, parents, rows, target = [], [], [], [p0]  # target: one row per block row, in order
    first, first_q = draw(q0, m, how, gen)
    for j, t1 in enumerate(first):
        node = len(tokens)
        tokens.append(t1)
        parents.append(-1)
        rows.append(None if first_q is None else first_q[j])
        target.append(TABLE[t1])
        second, second_q = draw(QTABLE[t1], c, how, gen)
        for i, t2 in enumerate(second):
            tokens.append(t2)
            parents.append(node)
            rows.append(None if second_q is None else second_q[i])
            target.append(torch.full((V,), 1.0 / V))
    draft_probs = None if how == "deterministic" else torch.stack(rows)
    path, next_token = tree_rejection_sample(torch.tensor(tokens), torch.tensor(parents), draft_probs,
                                             torch.stack(target), gen)
    emitted = [tokens[i] for i in path] + [next_token]
    if len(emitted) == 1:
        emitted.append(int(sample(TABLE[emitted[0]], gen)))
    return emitted[0], emitted[1]


def run(how: str, skew: float, p0: torch.Tensor = P0, q0: torch.Tensor = Q0, m: int = 3, c: int = 2,
        seed: int = 0) -> list[str]:
    """What is wrong with the first token's law and the (t1, t2) joint over trials(skew) trials."""
    gen = torch.Generator().manual_seed(seed)
    counts = torch.zeros(V, V, dtype=torch.float64)
    n = trials(skew)
    for _ in range(n):
        t1, t2 = one_trial(p0, q0, how, m, c, gen)
        counts[t1, t2] += 1
    empirical = counts / n
    exact = p0.double()[:, None] * TABLE.double()
    return check_laws([("first token", empirical.sum(1), p0.double()),
                       ("first two", empirical.flatten(), exact.flatten())], n, skew)


@pytest.mark.parametrize("how", ["iid", "without_replacement", "deterministic"])
@pytest.mark.parametrize("skew", POWER)
def test_multi_candidate_sampling_emits_the_target_distribution(how, skew):
    assert run(how, skew) == []


@pytest.mark.parametrize("skew", POWER)
def test_a_chain_through_the_tree_sampler_emits_the_target_distribution(skew):
    assert run("iid", skew, m=1, c=1) == []  # one child per node: a chain


@pytest.mark.parametrize("skew", POWER)
def test_disjoint_supports_still_emit_the_target_distribution(skew):
    assert run("iid", skew, DISJOINT_P0, DISJOINT_Q0) == []


@pytest.mark.parametrize("how", ["iid", "deterministic"])
def test_skipping_the_residual_update_between_candidates_is_caught(monkeypatch, how):
    monkeypatch.setattr(tree_verifier, "residual", lambda target, draft: target)
    problems = run(how, FAST_SKEW)
    assert any(problem.startswith("first token: TV") for problem in problems), "the buggy sampler passed"


def test_seeded_tree_sampling_repeats():
    def outputs(seed: int) -> list[tuple[int, int]]:
        gen = torch.Generator().manual_seed(seed)
        return [one_trial(P0, Q0, "iid", 3, 2, gen) for _ in range(50)]

    assert outputs(5) == outputs(5) and outputs(5) != outputs(6)
