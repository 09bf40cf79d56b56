"""Predicted outputs: the prediction drafts where the output is in it, re-aligns after an edit,
stays exact (greedy and sampled), and its accepted / rejected tokens are counted."""

from __future__ import annotations

import pytest
import torch

from tests.distribution import POWER, assert_follows, exact_marginals, runs_for, sample_runs
from tests.tiny import plain_greedy, tiny_llama
from verispec.core.errors import VerispecError
from verispec.core.policies import ConstantK, LoadCap
from verispec.core.stopping import StoppingRules
from verispec.core.types import DraftSource, SamplingParams
from verispec.decoding.constrained import GrammarDrafter, GrammarState
from verispec.decoding.engine import SpeculativeEngine
from verispec.decoding.sequence import SequenceSpec
from verispec.drafters.base import CAPABILITIES, Drafter, DraftRequest, Wrapper
from verispec.drafters.ngram import PromptLookupDrafter
from verispec.drafters.prediction import PredictionDrafter, PredictionFirst, realign

NEW = 40
PROMPT = [1, 60, 7, 9]


@pytest.fixture(scope="module")
def truth(target):
    return plain_greedy(target, PROMPT, NEW)


def edited(truth: list[int]) -> list[int]:
    """The output with a substitution, a deletion and an insertion: what an edit leaves."""
    p = list(truth)
    p[5] = (p[5] + 1) % 64
    del p[15]
    p.insert(25, 3)
    return p


def test_realign_finds_the_nearest_occurrence_after_the_last_agreement():
    assert realign([5, 6, 7, 8, 9], [4, 7], near=2) == 3
    assert realign([7, 1, 7, 2], [7], near=2) == 3  # the occurrence after `near` wins
    assert realign([7, 1, 7, 2], [7], near=4) == 3  # none after: the nearest before
    assert realign([5, 6], [9], near=0) is None


@pytest.mark.parametrize("wrap", [lambda inner: PredictionFirst([1, 2], inner),
                                  lambda inner: GrammarDrafter(GrammarState(None), inner)],
                         ids=["prediction", "grammar"])
def test_wrappers_take_every_capability_of_the_drafter_inside(wrap):
    """Every capability Drafter declares (a new one too) comes from the wrapped drafter, but the
    wrapper's OWN ones; with no drafter inside, Drafter's defaults."""
    assert {"needs_hidden", "hidden_layers", "adopts_prefill", "tree"} <= set(CAPABILITIES) - Wrapper.OWN
    inner = Drafter()
    for name in CAPABILITIES:
        setattr(inner, name, object())  # a value no wrapper has of its own
    wrapper = wrap(inner)
    for name in CAPABILITIES:
        if name in Wrapper.OWN:
            assert getattr(wrapper, name) is getattr(Wrapper, name), name
        else:
            assert getattr(wrapper, name) is getattr(inner, name), name
    alone = wrap(None)
    assert alone.uses_room and not alone.needs_hidden and alone.tree is None


def test_prediction_drafter_follows_and_realigns():
    drafter = PredictionDrafter([10, 11, 12, 13, 14, 15])

    def propose(tokens):
        return drafter.propose(DraftRequest(torch.tensor(tokens), 3, SamplingParams(), None)).tokens.tolist()

    assert propose([1, 2]) == [10, 11, 12]  # the output starts where the prediction does
    assert propose([1, 2, 10, 11]) == [12, 13, 14]
    assert propose([1, 2, 10, 11, 99, 13]) == [14, 15]  # 12 was replaced: re-aligned on 13
    with pytest.raises(VerispecError, match="empty"):
        PredictionDrafter([])


@pytest.mark.parametrize("drafter", [None, "pld"])
@pytest.mark.parametrize("k", [1, 5])
def test_predicted_outputs_match_plain_decoding_and_are_counted(target, truth, drafter, k):
    """ar and pld with a prediction: exact; the exact prediction drafts nearly all, an edited one
    is mostly accepted, some refused, and every drafted prediction token is counted once."""
    made = None if drafter is None else PromptLookupDrafter(max_ngram=3)
    engine = SpeculativeEngine(target, made, ConstantK(k))
    for prediction in (truth, edited(truth)):
        result = engine.generate(SequenceSpec(PROMPT, StoppingRules.build(NEW), prediction=prediction))
        assert result.token_ids == truth
        stats = result.stats
        drafted = sum(s.num_drafted for s in result.steps if s.source is DraftSource.PREDICTION)
        assert stats.accepted_prediction_tokens + stats.rejected_prediction_tokens == drafted
        assert stats.accepted_prediction_tokens > NEW // 2
        if prediction == truth:
            assert stats.rejected_prediction_tokens == 0 and stats.mean_accepted_tokens > 8
        else:
            assert stats.rejected_prediction_tokens > 0
            # re-aligned after the last edit (output position 25): prediction drafts accepted there
            position, after_edit = 0, 0
            for step in result.steps:
                if step.source is DraftSource.PREDICTION and position > 26:
                    after_edit += step.num_accepted
                position += len(step.tokens)
            assert after_edit >= 5
    plain = engine.generate(SequenceSpec(PROMPT, StoppingRules.build(NEW)))
    assert plain.token_ids == truth and plain.stats.accepted_prediction_tokens == 0


def test_a_batch_with_a_prediction_beside_a_row_without(target, truth):
    other = [1, 33, 5]
    engine = SpeculativeEngine(target, PromptLookupDrafter(), ConstantK(4), spawn=PromptLookupDrafter)
    results = engine.generate_batch([SequenceSpec(PROMPT, StoppingRules.build(NEW), prediction=truth),
                                     SequenceSpec(other, StoppingRules.build(NEW))])
    assert results[0].token_ids == truth and results[1].token_ids == plain_greedy(target, other, NEW)
    assert results[0].stats.accepted_prediction_tokens > NEW // 2
    assert results[1].stats.accepted_prediction_tokens == 0


@pytest.mark.parametrize("skew", POWER)
def test_predicted_outputs_sample_the_target_distribution(skew):
    """Sampling: the first three tokens follow the target's exact marginals (with power against a
    skew of TV 0.05: tests/distribution.py), with the prediction drafting and sometimes refused."""
    model = tiny_llama(seed=2, vocab=6, layers=1)
    prompt = [1, 3, 4, 5]
    sampling = SamplingParams(True, 1.5)
    engine = SpeculativeEngine(model, load_cap=LoadCap(()))
    exact = exact_marginals(model, prompt, 3, sampling)
    sampled = sample_runs(engine, prompt, 3, sampling, runs_for(exact, skew), prediction=[3, 4, 5])
    accepted = sum(r.stats.accepted_prediction_tokens for r in sampled.results)
    assert sampled.results[0].steps[0].source is DraftSource.PREDICTION
    assert 0 < accepted < 2 * sampled.runs
    sampled.check_drafting(positions=2)
    assert_follows(sampled, exact, "prediction", skew)
