"""Each sampling warp alone (verispec.core.sampling.warp_probs), against a distribution computed by
hand: temperature, top-k and top-p, each with ties, at its edges (k at and above the vocabulary's
size, p just above 0 and at 1), then the three in their order (temperature, top-k, top-p).

The distribution tests compare the engine's output with the target's law *after* warp_probs, so
an off-by-one inside a warp (a k-th token dropped, a p boundary moved) would pass them: these
tests pin the warps themselves. Expected values come from math.exp, not from torch's softmax.
"""

from __future__ import annotations

import math

import pytest
import torch

from verispec.core.sampling import warp_probs
from verispec.core.types import SamplingParams


def softmax(values: list[float]) -> list[float]:
    """By hand: exp(x - max) / sum, in float64 (-inf gives 0)."""
    top = max(values)
    weights = [0.0 if v == -math.inf else math.exp(v - top) for v in values]
    return [w / sum(weights) for w in weights]


def warp(logits: list[float], temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0) -> list[float]:
    params = SamplingParams(do_sample=True, temperature=temperature, top_k=top_k, top_p=top_p)
    return warp_probs(torch.tensor(logits), params).tolist()


def logits_of(probs: list[float]) -> list[float]:
    """Logits whose softmax is `probs` (0 -> -inf)."""
    return [math.log(p) if p > 0 else -math.inf for p in probs]


def close(got: list[float], want: list[float]) -> bool:
    return len(got) == len(want) and all(abs(g - w) < 1e-6 for g, w in zip(got, want))


LOGITS = [2.0, -1.0, 0.5, 3.0, 0.5, -4.0]


# -- temperature ---------------------------------------------------------------------------------

@pytest.mark.parametrize("temperature", [0.25, 0.7, 1.0, 1.6, 40.0])
def test_temperature_divides_the_logits(temperature):
    assert close(warp(LOGITS, temperature), softmax([x / temperature for x in LOGITS]))


def test_a_temperature_keeps_ties_tied_and_greedy_is_the_first_argmax():
    got = warp([1.0, 3.0, 3.0, 0.0], 0.5)
    assert got[1] == got[2] and close(got, softmax([2.0, 6.0, 6.0, 0.0]))
    greedy = warp_probs(torch.tensor([1.0, 3.0, 3.0, 0.0]), SamplingParams()).tolist()
    assert greedy == [0.0, 1.0, 0.0, 0.0]  # one-hot on the first of the tied maxima, as argmax


# -- top-k ---------------------------------------------------------------------------------------

@pytest.mark.parametrize(("k", "kept"), [(1, [3]), (2, [3, 0]), (3, [3, 0, 2, 4]), (4, [3, 0, 2, 4]),
                                         (5, [3, 0, 2, 4, 1])])
def test_top_k_keeps_the_k_likeliest_and_every_token_tied_with_the_kth(k, kept):
    """LOGITS ranked: 3 (3.0), 0 (2.0), 2 and 4 (0.5, tied), 1 (-1.0), 5 (-4.0): k = 3 ends in
    the tie, so both tied tokens stay (as Hugging Face's top-k does)."""
    want = softmax([x if i in kept else -math.inf for i, x in enumerate(LOGITS)])
    assert close(warp(LOGITS, top_k=k), want)


@pytest.mark.parametrize("k", [len(LOGITS), len(LOGITS) + 1, 10_000, 0])
def test_top_k_at_or_above_the_vocabulary_or_zero_keeps_everything(k):
    assert close(warp(LOGITS, top_k=k), softmax(LOGITS))


# -- top-p ---------------------------------------------------------------------------------------

PROBS = [0.1, 0.2, 0.4, 0.2, 0.05, 0.05]  # ranked: 2 (0.4), 1 and 3 (0.2 tied), 0, 4 and 5 (tied)


@pytest.mark.parametrize(("p", "kept"), [
    (0.3, [2]),  # the likeliest alone holds 0.4 >= 0.3
    (0.45, [2, 1, 3]),  # 0.4 before the tied pair: < 0.45, so both (not one of them) stay
    (0.8, [2, 1, 3]),  # 0.8 before token 0: not below 0.8
    (0.85, [2, 1, 3, 0]),
    (0.95, [2, 1, 3, 0, 4, 5]),  # 0.9 before the tied tail: both stay
])
def test_top_p_keeps_a_token_while_the_likelier_ones_hold_less_than_p(p, kept):
    """A token stays when the tokens strictly likelier than it hold less than p: the smallest set
    reaching p, and every token tied with its last member."""
    want = [x if i in kept else 0.0 for i, x in enumerate(PROBS)]
    want = [x / sum(want) for x in want]
    assert close(warp(logits_of(PROBS), top_p=p), want)


@pytest.mark.parametrize("p", [5e-324, 1e-300, 1e-9])
def test_top_p_just_above_zero_keeps_the_likeliest_and_its_ties(p):
    assert close(warp(logits_of(PROBS), top_p=p), [0, 0, 1, 0, 0, 0])
    assert close(warp(logits_of([0.2, 0.4, 0.0, 0.4]), top_p=p), [0, 0.5, 0, 0.5])  # tied maxima


def test_top_p_at_one_keeps_every_token_even_the_unlikeliest():
    logits = [0.0, -30.0, 1.0, -80.0]
    got = warp(logits, top_p=1.0)
    assert close(got, softmax(logits)) and all(x > 0 for x in got)


def test_top_p_just_below_one_drops_only_the_tail_past_it():
    probs = [0.5, 0.3, 0.1999, 0.0001]  # 0.9999 before the last
    want = [x / 0.9999 for x in probs[:3]] + [0.0]
    assert close(warp(logits_of(probs), top_p=0.9998), want)
    assert close(warp(logits_of(probs), top_p=1.0), probs)


# -- together ------------------------------------------------------------------------------------

def test_temperature_then_top_k_then_top_p():
    """T = 0.5 doubles LOGITS; top-k 4 keeps tokens 3, 0, 2 and 4; top-p 0.97 then cuts on the
    renormalised top-k law: 3 (0.870) and 0 (0.118) stay, the tied 2 and 4 (0.006 each) have
    0.988 before them and go."""
    scaled = [x / 0.5 for x in LOGITS]
    after_k = softmax([x if i in (3, 0, 2, 4) else -math.inf for i, x in enumerate(scaled)])
    assert after_k[3] < 0.97 < after_k[3] + after_k[0]
    want = [x if i in (3, 0) else 0.0 for i, x in enumerate(after_k)]
    want = [x / sum(want) for x in want]
    assert close(warp(LOGITS, 0.5, top_k=4, top_p=0.97), want)


def test_rows_are_warped_independently():
    rows = torch.tensor([LOGITS, LOGITS[::-1]])
    got = warp_probs(rows, SamplingParams(do_sample=True, temperature=0.7, top_k=3, top_p=0.9))
    for row, logits in zip(got.tolist(), rows.tolist()):
        assert close(row, warp(logits, 0.7, top_k=3, top_p=0.9))
