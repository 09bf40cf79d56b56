"""Greedy speculative decoding emits exactly the tokens of plain decoding (float32, CPU)."""

from __future__ import annotations

import pytest
import torch

from tests.drafters import OracleDrafter, RandomDrafter
from tests.tiny import VOCAB, plain_greedy, tiny_foreign, tiny_llama
from verispec.core.policies import ConstantK, HeuristicK
from verispec.core.stopping import StoppingRules
from verispec.core.tree import TreeSettings
from verispec.decoding.engine import SpeculativeEngine
from verispec.decoding.sequence import SequenceSpec
from verispec.drafters.early_exit import early_exit_drafter
from verispec.drafters.model import ModelDrafter
from verispec.drafters.ngram import PromptLookupDrafter

NEW = 48
PROMPTS = [[1, 17, 42, 9, 33, 17, 42, 5], [1, 60]]


@pytest.fixture(scope="module")
def references(target):
    return [plain_greedy(target, p, NEW) for p in PROMPTS]


def run(target, drafter, k, prompt, policy=None):
    engine = SpeculativeEngine(target, drafter, policy or ConstantK(k))
    return engine.generate(SequenceSpec(prompt, StoppingRules.build(NEW)))


def drafters(target, prompt, truth):
    """The forcing drafters plus every real one."""
    return {
        "self": ModelDrafter(target, VOCAB),
        "random": RandomDrafter(VOCAB),
        "oracle": OracleDrafter(len(prompt), truth, errors={0, 3, 4, 11, 12, 13, 30}, vocab=VOCAB),
        "draft-model": ModelDrafter(tiny_llama(seed=7, layers=1), VOCAB),
        "pld": PromptLookupDrafter(max_ngram=3),
        "pld-tree": PromptLookupDrafter(max_ngram=3, tree=TreeSettings(topk=3, nodes=12)),
        "early-exit": early_exit_drafter(target, 1, VOCAB),
        "self-tree": ModelDrafter(target, VOCAB, tree=TreeSettings(topk=2, nodes=32)),
        "draft-model-tree": ModelDrafter(tiny_llama(seed=7, layers=1), VOCAB, tree=TreeSettings(3, 48)),
        "early-exit-tree": early_exit_drafter(target, 1, VOCAB, tree=TreeSettings(3, 12)),
    }


# k = 1, 3, 8 and 16 in the default suite; the ks between them under `slow` (.ci/run runs them)
DEFAULT_KS = (1, 3, 8, 16)


@pytest.mark.parametrize("k", [k if k in DEFAULT_KS else pytest.param(k, marks=pytest.mark.slow)
                               for k in range(1, 17)])
def test_every_drafter_matches_plain_decoding(target, references, k):
    for prompt, truth in zip(PROMPTS, references):
        for name, drafter in drafters(target, prompt, truth).items():
            result = run(target, drafter, k, prompt)
            assert result.token_ids == truth, f"{name} with k={k} diverged from plain decoding"
            assert result.stats.new_tokens == NEW


@pytest.mark.parametrize("k", [1, 4, 7])
def test_models_off_the_lean_path_match_plain_decoding(k):
    """Architectures verispec.model.lean does not run go through their own forward: still exact."""
    model = tiny_foreign(seed=3)
    for prompt in PROMPTS:
        truth = plain_greedy(model, prompt, NEW)
        for name, drafter in {"self": ModelDrafter(model, VOCAB), "pld": PromptLookupDrafter(max_ngram=3),
                              "early-exit": early_exit_drafter(model, 1, VOCAB),
                              "self-tree": ModelDrafter(model, VOCAB, tree=TreeSettings(topk=2, nodes=16)),
                              }.items():
            engine = SpeculativeEngine(model, drafter, ConstantK(k))
            assert engine.target.lean is None
            result = engine.generate(SequenceSpec(prompt, StoppingRules.build(NEW)))
            assert result.token_ids == truth, f"{name} with k={k} diverged from plain decoding"


def test_forcing_drafters_force_their_acceptance_pattern(target, references):
    prompt, truth = PROMPTS[0], references[0]
    everything = run(target, ModelDrafter(target, VOCAB), 8, prompt)
    assert all(step.num_accepted == step.num_drafted for step in everything.steps)
    assert everything.stats.mean_accepted_tokens > 5
    nothing = run(target, RandomDrafter(VOCAB), 8, prompt)
    assert nothing.stats.mean_accepted_tokens < 1.3
    oracle = run(target, OracleDrafter(len(prompt), truth, {0, 3, 11, 30}, VOCAB), 8, prompt)
    partial = [s.num_accepted for s in oracle.steps if 0 < s.num_accepted < s.num_drafted]
    assert partial, "the oracle should produce partially accepted drafts"
    # A draft starting at position 0 hits the error at 0 at once: the first step accepts nothing.
    assert oracle.steps[0].num_accepted == 0


def test_every_step_adds_its_accepted_drafts_and_one_target_token(target, references):
    """A fully accepted draft still ends with the target's bonus token, a refused one with its
    correction: every step emits num_accepted + 1 tokens. Stepped one at a time with a bound, so a
    step that emits nothing fails here instead of looping forever."""
    prompt, truth = PROMPTS[0], references[0]
    cases = ((ModelDrafter(target, VOCAB), 4), (RandomDrafter(VOCAB), 4), (ModelDrafter(target, VOCAB), 0))
    for drafter, k in cases:
        engine = SpeculativeEngine(target, drafter, ConstantK(k))
        emitted, full = [], 0
        for _, step in zip(range(NEW), engine.steps(SequenceSpec(prompt, StoppingRules.build(NEW)))):
            assert len(step.tokens) == step.num_accepted + 1, (k, step.num_drafted, step.num_accepted)
            full += step.num_drafted > 0 and step.num_accepted == step.num_drafted
            emitted += step.tokens
        assert emitted == truth
        assert full > 0 or k == 0 or isinstance(drafter, RandomDrafter)


def test_heuristic_schedule_and_confidence_threshold_stay_exact(target, references):
    for prompt, truth in zip(PROMPTS, references):
        result = run(target, ModelDrafter(tiny_llama(seed=7, layers=1), VOCAB), 0, prompt, HeuristicK(3))
        assert result.token_ids == truth
        stopped_early = ModelDrafter(target, VOCAB, confidence_threshold=0.9)
        result = run(target, stopped_early, 10, prompt)
        assert result.token_ids == truth
        assert min(s.num_drafted for s in result.steps[:-1]) < 10


def test_heuristic_schedule_follows_hf_rule():
    policy = HeuristicK(5)
    policy.update(5, 5)
    assert policy.next_k() == 7
    policy.update(7, 2)
    assert policy.next_k() == 6
    for _ in range(10):
        policy.update(policy.next_k(), 0)
    assert policy.next_k() == 1


def test_kv_cache_stays_consistent_over_many_rejection_cycles(target):
    """Hundreds of rejections: caches keep exactly the committed length, output still exact."""
    prompt = PROMPTS[0]
    truth = plain_greedy(target, prompt, 300)
    oracle = OracleDrafter(len(prompt), truth, errors=set(range(0, 300, 3)), vocab=VOCAB)
    draft = ModelDrafter(tiny_llama(seed=3, layers=1), VOCAB)
    for drafter in (oracle, draft):
        engine = SpeculativeEngine(target, drafter, ConstantK(6))
        length = len(prompt)
        for step in engine.steps(SequenceSpec(prompt, StoppingRules.build(300))):
            length += len(step.tokens)
            assert engine.target.length == length - 1  # all committed tokens but the last
            if isinstance(drafter, ModelDrafter):
                assert drafter.lm.length <= length - 1
        assert length == len(prompt) + 300
    result = SpeculativeEngine(target, oracle, ConstantK(6)).generate(
        SequenceSpec(prompt, StoppingRules.build(300)))
    assert result.token_ids == truth
    assert sum(s.num_accepted < s.num_drafted for s in result.steps) > 50


def test_memory_is_flat_over_many_calls(target):
    """Repeated generations reuse nothing stale: cache sizes return to the same value each call
    (a cache that kept anything would grow at every call: 30 show it as 200 did)."""
    engine = SpeculativeEngine(target, ModelDrafter(tiny_llama(seed=7, layers=1), VOCAB), ConstantK(4))
    sizes = []
    for _ in range(30):
        engine.generate(SequenceSpec(PROMPTS[1], StoppingRules.build(6)))
        sizes.append((engine.target.length, engine.drafter.lm.length))
    assert len(set(sizes)) == 1


def test_k_zero_is_plain_decoding(target, references):
    result = run(target, ModelDrafter(target, VOCAB), 0, PROMPTS[0])
    assert result.token_ids == references[0]
    assert result.stats.target_forwards == NEW and result.stats.mean_accepted_tokens == 1.0


def test_huge_k_is_clamped(target, references):
    result = run(target, ModelDrafter(target, VOCAB), 10**6, PROMPTS[0])
    assert result.token_ids == references[0]
    assert max(s.num_drafted for s in result.steps) <= NEW - 1


def test_bfloat16_speculation_matches_bfloat16_plain_decoding():
    """Exactness is relative to the dtype the target runs in: here bfloat16 against bfloat16."""
    bf16 = tiny_llama(seed=0).to(torch.bfloat16)
    prompt = PROMPTS[0]
    plain = SpeculativeEngine(bf16).generate(SequenceSpec(prompt, StoppingRules.build(32))).token_ids
    assert SpeculativeEngine(bf16).generate(SequenceSpec(prompt, StoppingRules.build(32))).token_ids == plain
    fast = SpeculativeEngine(bf16, ModelDrafter(bf16, VOCAB), ConstantK(4))
    assert fast.generate(SequenceSpec(prompt, StoppingRules.build(32))).token_ids == plain


def test_a_model_drafter_tree_holds_its_own_chain(target, references):
    """The target drafting a tree for itself: branch 0 is its greedy chain, accepted in full."""
    prompt, truth = PROMPTS[0], references[0]
    result = run(target, ModelDrafter(target, VOCAB, tree=TreeSettings(topk=3, nodes=24)), 8, prompt)
    assert result.token_ids == truth
    assert all(s.num_accepted == s.tree.depth for s in result.steps if s.tree is not None)
    assert result.stats.mean_accepted_tokens > 5
    # nodes caps the depth: 3 branches of 12 nodes at most are 4 deep.
    capped = run(target, ModelDrafter(target, VOCAB, tree=TreeSettings(topk=3, nodes=12)), 8, prompt)
    assert capped.token_ids == truth
    assert max(s.tree.depth for s in capped.steps if s.tree is not None) == 4
