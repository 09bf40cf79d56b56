"""Suffix decoding: its index and frequency trees, exactness (greedy and sampled), and the
shared cache of earlier outputs (a repeated prompt drafts from the first pass's output)."""

from __future__ import annotations

import pytest
import torch

from tests.distribution import POWER, assert_follows, exact_marginals, runs_for, sample_runs
from tests.tiny import plain_greedy, tiny_llama
from verispec.core.errors import VerispecError
from verispec.core.policies import ConstantK, LoadCap
from verispec.core.stopping import StoppingRules
from verispec.core.tree import TreeSettings
from verispec.core.types import SamplingParams
from verispec.decoding.engine import SpeculativeEngine
from verispec.decoding.sequence import SequenceSpec
from verispec.drafters.suffix import SuffixDrafter, SuffixIndex, SuffixSettings, frequency_tree, shared_cache
from verispec.methods import build_engine
from verispec.model.loading import LoadedModel
from verispec.options import DraftOptions

NEW = 48
PROMPTS = [[1, 17, 42, 9, 33, 17, 42, 5, 9, 33, 17, 42], [1, 60, 7]]


def test_index_finds_the_longest_matches_most_recent_first():
    index = SuffixIndex()
    seq = index.start([5, 8, 9, 4, 7, 8, 9, 6])
    found = index.matches([3, 7, 8, 9], depth=8, k=3)
    assert found == [(3, seq, [6]), (2, seq, [4, 7, 8])]
    assert index.matches([3, 7, 8, 9], depth=8, k=3, skip=seq) == []
    assert index.matches([1, 2], depth=8, k=3) == []


def test_index_evicts_least_recently_used_sequences_within_its_bound():
    index = SuffixIndex(max_tokens=10)
    a = index.start([1, 2, 3, 4])
    index.start([5, 6, 7, 8])
    index.touch({a})  # b is now the least recently used
    index.start([9, 10, 11])
    assert len(index) == 7 and index.sequences == 2
    assert index.matches([6, 7], 8, 2) == []  # b went, and its entries with it
    assert index.matches([2, 3], 8, 2) == [(2, a, [4])]
    index.resize(3)
    assert len(index) == 3 and index.matches([2, 3], 8, 2) == []


def test_frequency_tree_takes_the_most_frequent_continuations():
    continuations = [[5, 6], [5, 6], [5, 7], [8]]
    assert frequency_tree(continuations, 4, 0.1, None) == ([5, 6], [-1, 0], 0.75 + 0.5)
    tokens, parents, score = frequency_tree(continuations, 4, 0.1, TreeSettings(2, 8))
    assert (tokens, parents) == ([5, 6, 8, 7], [-1, 0, -1, 0]) and score == pytest.approx(1.75)
    assert frequency_tree(continuations, 4, 0.3, TreeSettings(2, 8))[0] == [5, 6]  # 8, 7: 1/4
    assert frequency_tree(continuations, 1, 0.1, None)[0] == [5]  # depth cut


def test_bad_settings_are_refused():
    with pytest.raises(VerispecError, match="factor"):
        SuffixSettings(factor=0)
    with pytest.raises(VerispecError, match="cache size"):
        SuffixSettings(cache_tokens=-1)


@pytest.mark.parametrize("k", [1, 4, 16])
@pytest.mark.parametrize("tree", [None, TreeSettings(3, 12)])
def test_suffix_matches_plain_decoding_first_and_second_pass(target, k, tree):
    """Greedy: identical tokens, alone and with a cache holding the first pass's output (where
    the second pass drafts nearly everything)."""
    cache = SuffixIndex(10_000)
    branched = 0
    for prompt in PROMPTS:
        truth = plain_greedy(target, prompt, NEW)
        taus = []
        for _ in range(2):
            engine = SpeculativeEngine(target, SuffixDrafter(SuffixSettings(), cache, tree), ConstantK(k))
            result = engine.generate(SequenceSpec(prompt, StoppingRules.build(NEW)))
            assert result.token_ids == truth, f"k={k} tree={tree} diverged from plain decoding"
            taus.append(result.stats.mean_accepted_tokens)
            branched += sum(s.tree is not None for s in result.steps)
        if k > 1:
            assert taus[1] > taus[0] and taus[1] >= min(k, 4), taus
    assert (branched > 0) == (tree is not None)  # trees drafted, where asked for


@pytest.mark.parametrize("skew", POWER)
def test_suffix_samples_the_target_distribution(skew):
    """Sampling (temperature 1.5): the first three tokens follow the target's exact marginals
    (with power against a skew of TV 0.05: tests/distribution.py), with drafts both accepted and
    refused."""
    model = tiny_llama(seed=2, vocab=6, layers=1)
    prompt = [1, 3, 4, 5, 3, 4, 2, 3, 4, 5, 3, 4]
    sampling = SamplingParams(True, 1.5)
    def make():
        return SuffixDrafter(SuffixSettings(cache_tokens=0))
    engine = SpeculativeEngine(model, make(), ConstantK(2), spawn=make, load_cap=LoadCap(()))
    exact = exact_marginals(model, prompt, 3, sampling)
    sampled = sample_runs(engine, prompt, 3, sampling, runs_for(exact, skew))
    assert sampled.results[0].steps[0].num_drafted == 2  # the drafter drafted at the first step
    sampled.check_drafting(positions=2)
    assert_follows(sampled, exact, "suffix", skew)


def test_generate_over_prompts_twice_shares_earlier_outputs(tiny_dir):
    """Through the registry: `suffix` in a batch of prompts, then the same prompts again: the same
    tokens as ar, and the second pass drafts from the first pass's outputs (higher tau)."""
    from verispec.model.loading import load
    target = load(str(tiny_dir))
    assert isinstance(target, LoadedModel)
    shared_cache(target.model, SuffixSettings.cache_tokens).clear()
    ar = build_engine(target, "ar").generate_batch(SequenceSpec.batch(PROMPTS, StoppingRules.build(NEW)))
    passes = []
    for _ in range(2):
        engine = build_engine(target, "suffix", DraftOptions(k=8))
        passes.append(engine.generate_batch(SequenceSpec.batch(PROMPTS, StoppingRules.build(NEW))))
    for results in passes:
        assert [r.token_ids for r in results] == [r.token_ids for r in ar]
    tau = [sum(r.stats.new_tokens for r in rs) / sum(r.stats.target_forwards for r in rs) for rs in passes]
    assert tau[1] > tau[0] + 1, tau
    none = build_engine(target, "suffix", DraftOptions(k=8, suffix_cache_tokens=0))
    assert none.drafter.cache is None
    assert len(shared_cache(target.model, 0)) == 0  # a bound of 0 empties the shared cache


def test_suffix_draft_tokens_are_deterministic_one_hot():
    drafter = SuffixDrafter(SuffixSettings(cache_tokens=0))
    from verispec.drafters.base import DraftRequest
    proposal = drafter.propose(DraftRequest(torch.tensor([1, 2, 3, 1, 2]), 4, SamplingParams(), None))
    assert proposal.tokens.tolist() == [3, 1] and proposal.draft_probs is None
