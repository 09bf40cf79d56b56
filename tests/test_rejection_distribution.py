"""Statistical losslessness of the sampling verifier, `rejection_sample`.

Synthetic setup: a small vocabulary V, k draft positions, fixed target distributions p_0..p_k
(p_k is the bonus distribution) and draft distributions q_0..q_{k-1}; every batch element sees the
same rows, independent of earlier tokens. Draft tokens are sampled from q_i (or fixed, for a
deterministic drafter with draft_probs=None). One batched call of the sampler then gives, per batch
element, the token emitted at each position j:

    draft token j      if j <  num_accepted   (accepted)
    next_token         if j == num_accepted   (recovered, or the bonus when j == k)
    nothing            if j >  num_accepted

Because positions are independent here, the tokens emitted at position j by the batch elements
that reach it must be i.i.d. draws from p_j. We compare their empirical distribution with p_j by
total variation (TV) against tests.distribution.tv_threshold (derived for TV: a union bound over
the 2^V - 2 subsets of Hoeffding's inequality), the k + 1 positions of a run checked together at
false alarm 1e-4 (docs/testing.md, "Sample sizes with power").

The test can fail: `buggy_rejection_sample` is the classic bug (on rejection, resample from p
instead of norm(max(0, p - q))). Its position-j output is min(p, q) + (1 - beta) p with
beta = sum(min(p, q)), at TV (1 - beta) * TV(p, norm(max(0, p - q))) from p. The same check flags
it (asserted) at every drafted position where that analytic TV is at least the threshold plus
sqrt(ln(1 / 0.01) / (2 N)), which guarantees detection with probability >= 0.99. Which regimes
catch the bug:

    near_uniform    V=12, B=200k   caught at all 3 drafted positions (analytic TV 0.08-0.12)
    peaked          V=8,  B=1M     caught at both drafted positions: analytic TV 0.0184 and 0.0182
                                   against thresholds ~0.0031 at N ~ 1e6; at N = 2e4 the threshold
                                   (0.0199) is above it: this is where it hides at small N
    draft_eq_target V=10, B=100k   NOT caught: beta = 1, nothing is ever rejected
    disjoint        V=10, B=100k   NOT caught: beta = 0, the residual *is* p
    q_zero          V=10, B=200k   caught at both drafted positions (analytic TV 0.14-0.15)
    top_k_top_p     V=16, B=200k   caught at all 3 drafted positions (analytic TV 0.15-0.24)
    deterministic   V=8,  B=200k   caught at all 3 drafted positions (analytic TV p(d)(1 - p(d)),
                                   0.16-0.23)
    skew            V=8,  B=12k    a skew of TV exactly 0.05 at both drafted positions
                                   (`skewed_rejection_sample`: token 0's residual mass handed to
                                   token 1; scripts/mutate.py plants it in the verifier), at the
                                   sample size tests.distribution.samples_for_power gives: caught

The bonus position is never affected by either bug (its residual is p in both samplers).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch

from tests.distribution import FALSE_ALARM, MISS, SKEW, samples_for_power, tv, tv_threshold
from verispec.core.sampling import sample, warp_probs
from verispec.core.types import SamplingParams
from verispec.verifiers.rejection import rejection_sample

SEEDS = (0, 1, 2)

Sampler = Callable[[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Generator],
                   tuple[torch.Tensor, torch.Tensor]]


def rate_bound(n: int, delta: float = 1e-6) -> float:
    """Hoeffding: P(|empirical frequency of an event - its probability| > eps) <= delta."""
    return math.sqrt(math.log(2 / delta) / (2 * n))


def normalize(w: torch.Tensor) -> torch.Tensor:
    """Rows of non-negative weights [..., V] -> probabilities [..., V] (float32)."""
    w = w.double()
    return (w / w.sum(-1, keepdim=True)).float()


def buggy_rejection_sample(draft_tokens: torch.Tensor, draft_probs: torch.Tensor | None,
                           target_probs: torch.Tensor, generator: torch.Generator,
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """The classic bug: same acceptance rule, but on rejection resample from p, not the residual.

    Same signature and shapes as `rejection_sample`: draft_tokens [B, k], draft_probs [B, k, V]
    or None, target_probs [B, k + 1, V] -> (num_accepted [B], next_token [B]).
    """
    batch, k = draft_tokens.shape
    vocab = target_probs.shape[-1]
    if draft_probs is None:
        draft_probs = torch.nn.functional.one_hot(draft_tokens, vocab).to(target_probs.dtype)
    p_draft = target_probs[:, :k].gather(-1, draft_tokens.unsqueeze(-1)).squeeze(-1)  # [B, k]
    q_draft = draft_probs.gather(-1, draft_tokens.unsqueeze(-1)).squeeze(-1)  # [B, k]
    uniform = torch.rand(batch, k, generator=generator)  # [B, k]
    accepted = uniform * q_draft < p_draft  # [B, k]
    num_accepted = accepted.to(torch.int64).cumprod(-1).sum(-1)  # [B]
    p_next = target_probs[torch.arange(batch), num_accepted]  # [B, V]
    return num_accepted, sample(p_next, generator)  # BUG: should be norm(max(0, p - q))


def buggy_distribution(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Output distribution [V] of `buggy_rejection_sample` at a drafted position with p, q [V]."""
    overlap = torch.minimum(p.double(), q.double())  # [V]
    return overlap + (1 - overlap.sum()) * p.double()


def skewed_rejection_sample(draft_tokens: torch.Tensor, draft_probs: torch.Tensor | None,
                            target_probs: torch.Tensor, generator: torch.Generator,
                            ) -> tuple[torch.Tensor, torch.Tensor]:
    """A small bug: after a rejection, token 0's residual mass goes to its neighbour, token 1
    (drawing from the residual and emitting 1 for 0 is the same). At a drafted position the
    output is then off by TV max(0, p(0) - q(0)); the bonus is untouched. Same shapes as
    `rejection_sample`."""
    num_accepted, next_token = rejection_sample(draft_tokens, draft_probs, target_probs, generator)
    rejected = num_accepted < draft_tokens.shape[1]
    return num_accepted, torch.where(rejected & (next_token == 0), 1, next_token)


@dataclass(frozen=True)
class Regime:
    """One synthetic verification problem; the same rows for every batch element."""

    name: str
    target: torch.Tensor  # [k + 1, V]: p_0 .. p_{k-1}, then the bonus distribution p_k
    draft: torch.Tensor  # [k, V]: q_0 .. q_{k-1} (one-hot rows for a deterministic drafter)
    batch: int  # B, the number of independent verifications in the one batched call
    catches_bug: bool  # documented: the TV check flags `buggy_rejection_sample` here
    fixed_tokens: torch.Tensor | None = None  # [k]: deterministic drafter, draft_probs=None

    @property
    def k(self) -> int:
        return self.draft.shape[0]

    @property
    def delta(self) -> float:
        """Each position's share of the run's false-alarm probability (k + 1 positions)."""
        return FALSE_ALARM / (self.k + 1)

    @property
    def power_n(self) -> int:
        """Samples a position needs for power 0.99 against a skew of TV 0.05."""
        return samples_for_power(self.vocab, self.delta)

    @property
    def vocab(self) -> int:
        return self.target.shape[1]

    def reach(self) -> list[float]:
        """Analytic probability of reaching each position 0..k: prod_{i<j} sum(min(p_i, q_i))."""
        beta = torch.minimum(self.target[:-1].double(), self.draft.double()).sum(-1)  # [k]
        return [1.0] + beta.cumprod(0).tolist()

    def buggy_tv(self, j: int) -> float:
        """Analytic TV from p_j of the buggy sampler's output at position j (0 for the bonus)."""
        if j == self.k:
            return 0.0
        return tv(buggy_distribution(self.target[j], self.draft[j]), self.target[j])


@dataclass(frozen=True)
class PositionResult:
    """What one position of one run looked like."""

    n: int  # batch elements that reached the position (emitted a token there)
    tv: float  # TV(empirical distribution, p_j); nan when n == 0
    bound: float  # tv_threshold(n, V, FALSE_ALARM / (k + 1)); inf when n == 0
    empirical: torch.Tensor  # [V] float64 empirical distribution (zeros when n == 0)


def emitted_tokens(draft_tokens: torch.Tensor, num_accepted: torch.Tensor,
                   next_token: torch.Tensor) -> torch.Tensor:
    """Token emitted at each position 0..k, or -1 where nothing was emitted.

    draft_tokens [B, k], num_accepted [B], next_token [B] -> [B, k + 1] int64.
    """
    k = draft_tokens.shape[1]
    position = torch.arange(k + 1)  # [k + 1]
    n = num_accepted.unsqueeze(1)  # [B, 1]
    nxt = next_token.unsqueeze(1)  # [B, 1]
    drafted = torch.cat([draft_tokens, nxt], dim=1)  # [B, k + 1]; column k is never "accepted"
    return torch.where(position < n, drafted, torch.where(position == n, nxt, -1))


def run_regime(regime: Regime, seed: int, sampler: Sampler = rejection_sample,
               ) -> list[PositionResult]:
    """Draft, verify with one batched sampler call, and compare each position 0..k with p_j."""
    generator = torch.Generator().manual_seed(seed)
    k, vocab, batch = regime.k, regime.vocab, regime.batch
    if regime.fixed_tokens is None:
        draft_tokens = torch.multinomial(regime.draft, batch, replacement=True,
                                         generator=generator).T  # [B, k]
        draft_probs = regime.draft.expand(batch, k, vocab)  # [B, k, V]
    else:
        draft_tokens = regime.fixed_tokens.expand(batch, k)  # [B, k]
        draft_probs = None
    target_probs = regime.target.expand(batch, k + 1, vocab)  # [B, k + 1, V]
    num_accepted, next_token = sampler(draft_tokens, draft_probs, target_probs, generator)
    emitted = emitted_tokens(draft_tokens, num_accepted, next_token)  # [B, k + 1]

    results = []
    for j in range(k + 1):
        tokens = emitted[:, j]
        tokens = tokens[tokens >= 0]  # [N_j]
        n = tokens.numel()
        if n == 0:
            results.append(PositionResult(0, math.nan, math.inf, torch.zeros(vocab, dtype=torch.float64)))
            continue
        empirical = torch.bincount(tokens, minlength=vocab).double() / n  # [V]
        results.append(PositionResult(n, tv(empirical, regime.target[j]),
                                      tv_threshold(n, vocab, regime.delta), empirical))
    return results


# ----------------------------------------------------------------------------------------------
# Regimes. Distributions are fixed by a design generator, independent of the sampling seeds.


def _near_uniform() -> Regime:
    g = torch.Generator().manual_seed(101)
    k, vocab = 3, 12
    target = normalize(1 + 0.6 * (2 * torch.rand(k + 1, vocab, generator=g) - 1))  # [k + 1, V]
    draft = normalize(1 + 0.6 * (2 * torch.rand(k, vocab, generator=g) - 1))  # [k, V]
    return Regime("near_uniform", target, draft, batch=200_000, catches_bug=True)


def _peaked() -> Regime:
    # Both concentrated on token 0 with the same tail; only the weights of tokens 0 and 1 differ.
    # TV(p, q) is 0.02, the buggy TV ~0.018: hidden at N ~ 1e5 (eps 0.0197), caught at 1e6.
    tail = [0.03, 0.015, 0.008, 0.004, 0.002, 0.001]
    target = torch.tensor([[0.86, 0.08] + tail,
                           [0.85, 0.09] + tail,
                           [0.70, 0.22] + tail])  # [3, 8]
    draft = torch.tensor([[0.88, 0.06] + tail,
                          [0.87, 0.07] + tail])  # [2, 8]
    return Regime("peaked", normalize(target), normalize(draft), batch=1_000_000, catches_bug=True)


def _draft_eq_target() -> Regime:
    g = torch.Generator().manual_seed(103)
    target = (torch.randn(4, 10, generator=g) * 1.5).softmax(-1)  # [k + 1 = 4, V = 10]
    return Regime("draft_eq_target", target, target[:3].clone(), batch=100_000, catches_bug=False)


def _disjoint() -> Regime:
    g = torch.Generator().manual_seed(104)
    k, vocab = 2, 10
    even = torch.arange(vocab) % 2 == 0  # [V]
    target = normalize(torch.rand(k + 1, vocab, generator=g) * even)  # [k + 1, V], even tokens
    draft = normalize(torch.rand(k, vocab, generator=g) * ~even)  # [k, V], odd tokens
    return Regime("disjoint", target, draft, batch=100_000, catches_bug=False)


def _q_zero() -> Regime:
    g = torch.Generator().manual_seed(105)
    k, vocab = 2, 10
    target = normalize(0.5 + torch.rand(k + 1, vocab, generator=g))  # [k + 1, V]
    target[:, 9] = 0  # p = 0: token 9 is drafted (q > 0) but must never be emitted
    target = normalize(target)
    draft = normalize(0.5 + torch.rand(k, vocab, generator=g))  # [k, V]
    draft[:, :2] = 0  # q = 0 where p > 0: tokens 0, 1 are only reachable through the residual
    draft[:, 9] = 0.6 * draft[:, 2:9].mean(-1)
    return Regime("q_zero", target, normalize(draft), batch=200_000, catches_bug=True)


TRUNCATING = SamplingParams(do_sample=True, temperature=0.8, top_k=10, top_p=0.9)


def _top_k_top_p() -> Regime:
    g = torch.Generator().manual_seed(106)
    k, vocab = 3, 16
    target_logits = torch.randn(k + 1, vocab, generator=g) * 1.2  # [k + 1, V]
    draft_logits = target_logits[:k] + torch.randn(k, vocab, generator=g) * 0.8  # [k, V]
    target = warp_probs(target_logits, TRUNCATING)  # [k + 1, V]
    draft = warp_probs(draft_logits, TRUNCATING)  # [k, V]
    return Regime("top_k_top_p", target, draft, batch=200_000, catches_bug=True)


def _deterministic() -> Regime:
    g = torch.Generator().manual_seed(107)
    k, vocab = 3, 8
    fixed = torch.tensor([2, 5, 0])  # [k]: the drafter's tokens
    target = normalize(torch.rand(k + 1, vocab, generator=g))  # [k + 1, V]
    for i, share in enumerate((0.75, 0.65, 0.8)):  # p_i(fixed token), so each position is reached
        row = target[i].clone()
        row[fixed[i]] = 0
        target[i] = normalize(row) * (1 - share)
        target[i, fixed[i]] = share
    draft = torch.nn.functional.one_hot(fixed, vocab).float()  # [k, V]: one-hot q
    return Regime("deterministic", target, draft, batch=200_000, catches_bug=True,
                  fixed_tokens=fixed)


def _skew() -> Regime:
    """q_j = p_j with 0.05 of token 0's mass moved to another token, and 0.04 shifted between two
    more: p(0) - q(0) = 0.05 exactly, so `skewed_rejection_sample` is off by TV 0.05. The batch
    gives each position the power sample size (reach ~0.91 and ~0.83)."""
    g = torch.Generator().manual_seed(108)
    k, vocab = 2, 8
    target = normalize(0.5 + torch.rand(k + 1, vocab, generator=g)).double()  # [k + 1, V]
    draft = target[:k].clone()  # [k, V]
    for j in range(k):
        draft[j, 0] -= SKEW
        draft[j, 2 + j] += SKEW
        draft[j, 4] += 0.04
        draft[j, 6] -= 0.04
    return Regime("skew", target.float(), draft.float(), batch=12_000, catches_bug=True)


REGIMES: dict[str, Regime] = {r.name: r for r in (
    _near_uniform(), _peaked(), _draft_eq_target(), _disjoint(), _q_zero(), _top_k_top_p(),
    _deterministic(), _skew())}


SAMPLERS: dict[str, Sampler] = {"exact": rejection_sample, "buggy": buggy_rejection_sample,
                                 "skewed": skewed_rejection_sample}


@functools.cache
def results_for(name: str, seed: int, sampler: str = "exact") -> list[PositionResult]:
    """Cached run_regime, so each (regime, seed, sampler) is sampled once per session."""
    return run_regime(REGIMES[name], seed, SAMPLERS[sampler])


def detectable(analytic: float, res: PositionResult) -> bool:
    """A skew of TV `analytic` at this position is caught with probability >= 1 - MISS: it
    clears the threshold by Hoeffding's one-sided margin for the position's sample size."""
    return analytic >= res.bound + math.sqrt(math.log(1 / MISS) / (2 * res.n))


# ----------------------------------------------------------------------------------------------
# Losslessness of the real sampler.


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("name", list(REGIMES))
def test_emitted_tokens_follow_target(name: str, seed: int) -> None:
    """At every reachable position (bonus included) the emitted tokens are distributed as p_j.

    TV(empirical, p_j) < tv_threshold(N_j, V, delta), with N_j at least the sample size giving
    power 0.99 against a skew of TV 0.05; unreachable positions (reach 0, the disjoint regime)
    must never be reached.
    """
    regime = REGIMES[name]
    for j, (res, reach) in enumerate(zip(results_for(name, seed), regime.reach())):
        if reach == 0:
            assert res.n == 0, f"{name} position {j} is unreachable but was reached {res.n} times"
            continue
        assert res.n >= regime.power_n, f"{name} position {j}: only {res.n} samples"
        # Exact part: a token with p_j = 0 is never emitted (top-k/top-p cut-offs, q_zero's token 9).
        assert (res.empirical[regime.target[j] == 0] == 0).all(), f"{name} position {j}"
        assert res.tv < res.bound, (
            f"{name} seed {seed} position {j}: TV {res.tv:.5f} > bound {res.bound:.5f} (N={res.n})")


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("name", list(REGIMES))
def test_acceptance_rates_match_overlap(name: str, seed: int) -> None:
    """Each position is reached with probability prod_{i<j} sum(min(p_i, q_i)).

    Losslessness alone would also hold for a sampler that rejects everything and samples from p.
    """
    regime = REGIMES[name]
    for j, (res, reach) in enumerate(zip(results_for(name, seed), regime.reach())):
        assert abs(res.n / regime.batch - reach) <= rate_bound(regime.batch), (
            f"{name} position {j}: reached {res.n / regime.batch:.5f}, expected {reach:.5f}")


def test_regimes_are_what_they_claim() -> None:
    """Sanity of the synthetic designs, so that each regime exercises what its name says."""
    r = REGIMES["draft_eq_target"]
    assert r.reach() == pytest.approx([1.0] * (r.k + 1))
    assert REGIMES["disjoint"].reach()[1:] == [0.0] * REGIMES["disjoint"].k
    r = REGIMES["q_zero"]
    assert ((r.draft == 0) & (r.target[:-1] > 0)).any() and ((r.draft > 0) & (r.target[:-1] == 0)).any()
    r = REGIMES["top_k_top_p"]
    assert ((r.target == 0).sum(-1) >= r.vocab - TRUNCATING.top_k).all()  # truncation is active
    assert ((r.target[:-1] > 0) != (r.draft > 0)).any()  # and supports differ somewhere
    r = REGIMES["peaked"]
    assert (r.target.max(-1).values >= 0.7).all() and (r.draft.max(-1).values >= 0.85).all()
    for regime in REGIMES.values():
        assert torch.allclose(regime.target.sum(-1), torch.ones(regime.k + 1))
        assert torch.allclose(regime.draft.sum(-1), torch.ones(regime.k))


# ----------------------------------------------------------------------------------------------
# The same check flags the classic bug.


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("name", list(REGIMES))
def test_check_flags_residual_bug(name: str, seed: int) -> None:
    """`buggy_rejection_sample` fails the losslessness check wherever the bug is detectable.

    Per position: where the analytic buggy TV clears the threshold by the power margin
    (`detectable`: caught with probability >= 0.99) the check flags it; where the bug leaves the
    position unchanged (analytic TV 0) the check passes it. The buggy sampler's empirical
    distribution must also match the analytic buggy law, so the variant really is the bug the
    module docstring describes.
    """
    regime = REGIMES[name]
    flagged: dict[int, bool] = {}
    for j, (res, reach) in enumerate(zip(results_for(name, seed, "buggy"), regime.reach())):
        if reach == 0:
            continue
        assert res.n >= regime.power_n
        analytic = regime.buggy_tv(j)
        if detectable(analytic, res):
            assert res.tv >= res.bound, (
                f"{name} seed {seed} position {j}: bug not flagged, TV {res.tv:.5f} < "
                f"bound {res.bound:.5f} (analytic buggy TV {analytic:.5f}, N={res.n})")
        elif analytic < 1e-9:
            assert res.tv < res.bound
        expected = (buggy_distribution(regime.target[j], regime.draft[j]) if j < regime.k
                    else regime.target[j].double())  # [V]
        assert tv(res.empirical, expected) < res.bound, f"{name} position {j}: not the buggy law"
        flagged[j] = res.tv >= res.bound
    assert any(flagged.values()) == regime.catches_bug, f"{name}: flagged positions {flagged}"


def test_peaked_bug_needs_large_n() -> None:
    """In the peaked regime the bug's TV is below the threshold at N = 2e4 but clears it by the
    power margin at the N ~ 1e6 the regime runs."""
    regime = REGIMES["peaked"]
    for j in range(regime.k):
        analytic = regime.buggy_tv(j)
        assert analytic < tv_threshold(20_000, regime.vocab, regime.delta)
        n = int(regime.reach()[j] * regime.batch * 0.99)
        assert detectable(analytic, PositionResult(n, math.nan, tv_threshold(n, regime.vocab, regime.delta),
                                                   torch.zeros(regime.vocab)))


@pytest.mark.parametrize("seed", SEEDS)
def test_check_flags_a_skew_of_tv_005_at_the_power_sample_size(seed: int) -> None:
    """The skew regime at the sample size derived for power 0.99 against TV 0.05: the exact
    sampler passes (test_emitted_tokens_follow_target) and `skewed_rejection_sample`, whose output
    is off by TV exactly 0.05 at both drafted positions, is flagged at each."""
    regime = REGIMES["skew"]
    for j, res in enumerate(results_for("skew", seed, "skewed")):
        p, q = regime.target[j].double(), regime.draft[j].double() if j < regime.k else None
        analytic = 0.0 if q is None else max(0.0, float(p[0] - q[0]))
        assert res.n >= regime.power_n
        if j < regime.k:
            assert analytic == pytest.approx(SKEW, abs=1e-6)
            assert res.tv >= res.bound, f"seed {seed} position {j}: TV {res.tv:.4f} < {res.bound:.4f}"
        else:
            assert res.tv < res.bound  # the bonus is untouched


# ----------------------------------------------------------------------------------------------
# Reproducibility, the docstring example, direct unit checks.


@pytest.mark.parametrize("name", ["near_uniform", "deterministic"])
def test_seeded_runs_repeat_exactly(name: str) -> None:
    """Same seed -> identical (num_accepted, next_token); another seed -> different outputs."""
    regime = REGIMES[name]
    small = Regime(regime.name, regime.target, regime.draft, 5_000, regime.catches_bug,
                   regime.fixed_tokens)

    def once(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(seed)
        if small.fixed_tokens is None:
            draft_tokens = torch.multinomial(small.draft, small.batch, True, generator=g).T  # [B, k]
            draft_probs = small.draft.expand(small.batch, small.k, small.vocab)  # [B, k, V]
        else:
            draft_tokens, draft_probs = small.fixed_tokens.expand(small.batch, small.k), None
        return rejection_sample(draft_tokens, draft_probs,
                                small.target.expand(small.batch, small.k + 1, small.vocab), g)

    first, again, other = once(7), once(7), once(8)
    assert torch.equal(first[0], again[0]) and torch.equal(first[1], again[1])
    assert not (torch.equal(first[0], other[0]) and torch.equal(first[1], other[1]))


def test_docstring_worked_example() -> None:
    """Vocab 2, k = 1, p_0 = [0.5, 0.5], q_0 = [0.9, 0.1]."""
    batch = 200_000
    p = torch.tensor([[0.5, 0.5], [0.3, 0.7]]).expand(batch, 2, 2)  # [B, k + 1, V]
    q = torch.tensor([[0.9, 0.1]]).expand(batch, 1, 2)  # [B, k, V]
    g = torch.Generator().manual_seed(0)

    # Draft token 0 is accepted with probability 0.5 / 0.9; a rejection recovers token 1.
    zeros = torch.zeros(batch, 1, dtype=torch.int64)  # [B, k]
    num_accepted, next_token = rejection_sample(zeros, q, p, g)
    assert abs(num_accepted.double().mean().item() - 0.5 / 0.9) <= rate_bound(batch)
    assert (next_token[num_accepted == 0] == 1).all()
    # Draft token 1 (p / q = 5) is always accepted.
    num_accepted, _ = rejection_sample(torch.ones(batch, 1, dtype=torch.int64), q, p, g)
    assert (num_accepted == 1).all()
    # Drafting from q, token 0 comes out with probability 0.9 * 0.5 / 0.9 = 0.5.
    draft = torch.multinomial(q[0], batch, replacement=True, generator=g).T  # [B, 1]
    num_accepted, next_token = rejection_sample(draft, q, p, g)
    first = torch.where(num_accepted == 1, draft[:, 0], next_token)  # [B]
    assert abs((first == 0).double().mean().item() - 0.5) <= rate_bound(batch)


def test_zero_target_probability_is_never_accepted() -> None:
    """A drafted token with p = 0 is always rejected and never emitted, with or without q."""
    batch = 10_000
    p = torch.tensor([[0.4, 0.6, 0.0, 0.0], [0.25, 0.25, 0.25, 0.25]]).expand(batch, 2, 4)
    q = torch.tensor([[0.1, 0.1, 0.7, 0.1]]).expand(batch, 1, 4)  # [B, 1, V]
    g = torch.Generator().manual_seed(1)
    for draft_probs in (q, None):
        draft = torch.full((batch, 1), 2)  # [B, 1]: token 2, p = 0
        num_accepted, next_token = rejection_sample(draft, draft_probs, p, g)
        assert (num_accepted == 0).all()
        assert ((next_token == 0) | (next_token == 1)).all()


def test_zero_draft_probability_is_accepted() -> None:
    """A drafted token with q = 0 but p > 0 is always accepted (min(1, p / q) = 1)."""
    batch = 10_000
    p = torch.tensor([[0.3, 0.3, 0.4], [0.2, 0.3, 0.5]]).expand(batch, 2, 3)  # [B, k + 1, V]
    q = torch.tensor([[0.0, 0.5, 0.5]]).expand(batch, 1, 3)  # [B, k, V]
    num_accepted, _ = rejection_sample(torch.zeros(batch, 1, dtype=torch.int64), q, p,
                                       torch.Generator().manual_seed(2))
    assert (num_accepted == 1).all()


def test_all_accepted_gives_bonus_from_last_target_row() -> None:
    """When every draft token is accepted the next token is drawn from p_k alone."""
    batch = 10_000
    # Deterministic drafter and one-hot targets on its tokens: always accepted; bonus row one-hot.
    p = torch.tensor([[0, 1.0, 0, 0], [0, 0, 0, 1.0], [0, 0, 1.0, 0]]).expand(batch, 3, 4)
    draft = torch.tensor([1, 3]).expand(batch, 2)  # [B, k]
    num_accepted, next_token = rejection_sample(draft, None, p, torch.Generator().manual_seed(3))
    assert (num_accepted == 2).all() and (next_token == 2).all()
    # Statistically, with q = p: the bonus follows p_k (see also the draft_eq_target regime).
    regime = REGIMES["draft_eq_target"]
    bonus = results_for("draft_eq_target", SEEDS[0])[regime.k]
    assert bonus.n == regime.batch and bonus.tv <= bonus.bound
