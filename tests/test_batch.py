"""Batched speculative decoding: every row is what its prompt gives alone (float32, greedy), the
rows' distributions are exact under sampling, sequences join and leave between steps, and memory
stays flat."""

from __future__ import annotations

import resource

import pytest
import torch

from tests.distribution import POWER, assert_follows, exact_marginals, runs_for, sample_runs
from tests.drafters import RandomDrafter
from tests.tiny import EOS, VOCAB, save_tiny, tiny_foreign, tiny_llama
from verispec.core.errors import VerispecError
from verispec.core.policies import ConstantK, HeuristicK, LoadCap
from verispec.core.stopping import StoppingRules
from verispec.core.tree import TreeSettings
from verispec.core.types import SamplingParams
from verispec.decoding.engine import SpeculativeEngine
from verispec.decoding.sequence import SequenceSpec
from verispec.drafters.early_exit import early_exit_drafter
from verispec.drafters.lookahead import LookaheadDrafter
from verispec.drafters.model import ModelDrafter
from verispec.drafters.ngram import PromptLookupDrafter
from verispec.methods import build_engine, build_speculation
from verispec.model.cached_model import CachedModel
from verispec.model.loading import LoadedModel, load_model
from verispec.options import DraftOptions
from verispec.request import build_request

# Rows of different lengths, repetitive (lookup finds drafts) and not; budgets end at different
# steps; row 3 also stops at an EOS its solo decoding reaches (rules_for).
PROMPTS = [[1, 17, 42, 9, 33, 17, 42, 5], [1, 60], [1, 5, 9, 13, 5, 9, 13, 5, 9], [1, 22, 23]]
BUDGETS = [40, 23, 31, 36]


def makers(target) -> dict:
    """Drafter factories: each row gets its own drafter."""
    draft = tiny_llama(seed=7, layers=1)
    return {
        "self": lambda: ModelDrafter(target, VOCAB),
        "random": lambda: RandomDrafter(VOCAB),
        "pld": lambda: PromptLookupDrafter(max_ngram=3, min_ngram=1),
        "pld-tree": lambda: PromptLookupDrafter(max_ngram=3, min_ngram=1, tree=TreeSettings(3, 12)),
        "draft-model": lambda: ModelDrafter(draft, VOCAB),
        "draft-model-tree": lambda: ModelDrafter(draft, VOCAB, tree=TreeSettings(3, 16)),
        "early-exit": lambda: early_exit_drafter(target, 1, VOCAB),
        "lookahead": lambda: LookaheadDrafter(3, 4, 3, pool_context=True),  # side branch per row
    }


def rules_for(target) -> list[StoppingRules]:
    """Each row's budget; row 3 stops at the 11th token of its solo decoding, made its EOS."""
    solo = SpeculativeEngine(target).generate(
        SequenceSpec(PROMPTS[3], StoppingRules.build(BUDGETS[3]))).token_ids
    eos = solo[10]
    assert eos not in solo[:10]
    rules = [StoppingRules.build(b) for b in BUDGETS]
    rules[3] = StoppingRules.build(BUDGETS[3], eos)
    return rules


def solo(target, rules) -> list[list[int]]:
    engine = SpeculativeEngine(target)
    return [engine.generate(SequenceSpec(p, r)).token_ids for p, r in zip(PROMPTS, rules)]


@pytest.mark.parametrize("k", [1, 3, 8, 16])
def test_every_row_matches_its_prompt_decoded_alone(target, k):
    rules = rules_for(target)
    truth = solo(target, rules)
    assert len(truth[3]) == 11 and len({len(t) for t in truth}) == 4
    for name, make in makers(target).items():
        engine = SpeculativeEngine(target, make(), ConstantK(k), spawn=make)
        results = engine.generate_batch(SequenceSpec.batch(PROMPTS, rules))
        assert [r.token_ids for r in results] == truth, f"{name} with k={k}"
        assert [r.stats.new_tokens for r in results] == [len(t) for t in truth]
    assert not engine.active


def test_models_off_the_lean_path_batch_exactly():
    model = tiny_foreign(seed=3)
    rules = [StoppingRules.build(b) for b in BUDGETS]
    truth = solo(model, rules)
    for make in (lambda: PromptLookupDrafter(3, 1), lambda: ModelDrafter(model, VOCAB)):
        engine = SpeculativeEngine(model, make(), ConstantK(4), spawn=make)
        assert [r.token_ids for r in engine.generate_batch(SequenceSpec.batch(PROMPTS, rules))] == truth


def test_sequences_join_and_leave_between_steps(target):
    """Continuous batching: rows added while others run, one cancelled, all exact."""
    rules = [StoppingRules.build(b) for b in BUDGETS]
    truth = solo(target, rules)
    make = makers(target)["draft-model"]
    engine = SpeculativeEngine(target, make(), ConstantK(3), spawn=make)
    got: dict[int, list[int]] = {}
    ids = engine.add(SequenceSpec(PROMPTS[0], rules[0]))
    steps = 0
    doomed = None
    while engine.active or steps < 4:
        if steps == 2:
            ids += engine.add(SequenceSpec(PROMPTS[1], rules[1]))
            doomed = engine.add(SequenceSpec(PROMPTS[0], rules[0]))[0]
        if steps == 4:
            ids += engine.add(SequenceSpec(PROMPTS[2], rules[2]))
            ids += engine.add(SequenceSpec(PROMPTS[3], rules[3]))
        if steps == 5:
            engine.cancel(doomed)
        for row_id, step in engine.step():
            got.setdefault(row_id, []).extend(step.tokens)
        steps += 1
    assert [got[i] for i in ids] == truth
    assert 0 < len(got[doomed]) < BUDGETS[0]
    assert len(engine._free[engine.speculation]) <= 5  # caches and drafters are reused, not made per sequence


def test_learned_and_self_drafters_batch_through_build_engine(tmp_path):
    """Methods built by name (self-speculation adopting the prompt cache, staged lookup) batch too."""
    loaded = load_model(str(save_tiny(tmp_path, seed=0)))
    rules = [StoppingRules.build(b) for b in BUDGETS]
    truth = solo(loaded.model, rules)
    for method, options in (("self-int4-pld", DraftOptions(k=5)), ("self-int8", DraftOptions(k=4)),
                            ("pld", DraftOptions(tree="default"))):
        engine = build_engine(loaded, method, options)
        results = engine.generate_batch(SequenceSpec.batch(PROMPTS, rules))
        assert [r.token_ids for r in results] == truth, method


@pytest.mark.parametrize("skew", POWER)
def test_samples_share_the_prefill_and_follow_the_target_distribution(monkeypatch, skew):
    """n samples of one prompt in one batch: one prefill, copied into every row's cache; every row
    drafts at that batch size (no load cap: the measured default turns drafting off from 8 rows)
    with a sampling drafter; the first three tokens of the rows follow the target's exact law."""
    target16, vocab = tiny_llama(seed=2, vocab=16), 16
    draft = tiny_llama(seed=7, layers=1, vocab=vocab)
    make = lambda: ModelDrafter(draft, vocab)  # noqa: E731
    engine = SpeculativeEngine(target16, make(), ConstantK(3), spawn=make, load_cap=LoadCap(()))
    calls = {"prefill": 0, "copy_from": 0}
    for name in calls:
        original = getattr(CachedModel, name)

        def counted(self, *args, name=name, original=original, **kwargs):
            calls[name] += self is not None and self.model is target16
            return original(self, *args, **kwargs)

        monkeypatch.setattr(CachedModel, name, counted)
    prompt, sampling, per_batch = [1, 5, 9, 7, 5, 9], SamplingParams(do_sample=True), 500
    exact = exact_marginals(target16, prompt, 3, sampling)
    runs = runs_for(exact, skew)
    sampled = sample_runs(engine, prompt, 3, sampling, runs, per_batch)
    batches = -(-runs // per_batch)
    assert calls == {"prefill": batches, "copy_from": runs - batches}, calls
    sampled.check_drafting(positions=2)
    assert_follows(sampled, exact, "batched samples", skew)


@pytest.mark.parametrize("make_target", [tiny_llama, tiny_foreign], ids=["lean", "hugging-face"])
def test_samples_of_one_prompt_each_own_their_cache(make_target):
    """copy_from on both cache paths (verispec.model.lean's caches, Hugging Face's DynamicCache): each
    sample of one prompt starts from the shared prefill in a cache of its own, so it is what its
    seed gives alone."""
    model = make_target(seed=3)
    draft = tiny_llama(seed=7, layers=1)
    make = lambda: ModelDrafter(draft, VOCAB)  # noqa: E731
    engine = SpeculativeEngine(model, make(), ConstantK(3), spawn=make)
    assert (engine.target.lean is None) == (make_target is tiny_foreign)
    sampling, rules = SamplingParams(do_sample=True, temperature=0.9), StoppingRules.build(20)
    batched = engine.generate_batch(SequenceSpec.batch([PROMPTS[0]], rules, sampling, seed=5, sequences=3),
                                    sequences=3)
    alone = [engine.generate(SequenceSpec(PROMPTS[0], rules, sampling, seed=5 + i)) for i in range(3)]
    assert [r.token_ids for r in batched] == [r.token_ids for r in alone]
    assert len({tuple(r.token_ids) for r in alone}) == 3
    assert all(sum(s.num_drafted for s in r.steps) > 0 for r in batched)


@pytest.mark.parametrize("make_target", [tiny_llama, tiny_foreign], ids=["lean", "hugging-face"])
def test_copy_from_gives_a_cache_of_its_own(make_target):
    """copy_from on both cache paths: the copy continues as a fresh prefill of the same tokens
    would, and feeding it leaves the source as it was."""
    model = make_target(seed=3)
    source, copy, fresh = CachedModel(model), CachedModel(model), CachedModel(model)
    assert (source.lean is None) == (make_target is tiny_foreign)
    prompt = torch.tensor(PROMPTS[0])
    source.prefill(prompt)
    fresh.prefill(prompt)
    copy.copy_from(source)
    assert torch.equal(copy.forward(torch.tensor([5, 6])), fresh.forward(torch.tensor([5, 6])))
    assert source.length == len(PROMPTS[0])  # the copy's tokens did not land in the source
    fresh.rewind(len(PROMPTS[0]))
    assert torch.equal(source.forward(torch.tensor([7])), fresh.forward(torch.tensor([7])))


def test_each_row_adapts_its_own_draft_length(target):
    """A schedule that follows acceptance (HeuristicK) in a batch: each row's draft lengths are
    those of its prompt decoded alone, however the other rows fare."""
    make = lambda: early_exit_drafter(target, 2, VOCAB)  # noqa: E731 (accepted now and then)
    rules = [StoppingRules.build(b) for b in BUDGETS]
    solo_engine = SpeculativeEngine(target, make(), HeuristicK(2))
    alone = [[s.num_drafted for s in solo_engine.generate(SequenceSpec(p, r)).steps]
             for p, r in zip(PROMPTS, rules)]
    engine = SpeculativeEngine(target, make(), HeuristicK(2), spawn=make, load_cap=LoadCap(()))
    together = [[s.num_drafted for s in r.steps]
                for r in engine.generate_batch(SequenceSpec.batch(PROMPTS, rules))]
    assert together == alone
    assert sum(len(set(lengths)) > 1 for lengths in alone) >= 2  # rows' k moved
    assert len({tuple(lengths[:6]) for lengths in alone}) > 2  # each its own way


def test_seeded_batches_repeat_and_rows_differ(target):
    make = lambda: PromptLookupDrafter(3, 1)  # noqa: E731
    engine = SpeculativeEngine(target, make(), ConstantK(4), spawn=make)
    sampling = SamplingParams(do_sample=True, temperature=1.0)
    specs = SequenceSpec.batch(PROMPTS[:2], StoppingRules.build(20), sampling, seed=5, sequences=3)
    runs = [[r.token_ids for r in engine.generate_batch(specs, sequences=3)] for _ in range(2)]
    assert runs[0] == runs[1]
    assert len({tuple(t) for t in runs[0][:3]}) > 1  # a prompt's samples are not copies


def test_load_cap_limits_drafts_by_batch_size(target):
    make = lambda: ModelDrafter(target, VOCAB)  # noqa: E731
    cap = LoadCap(((2, 2), (4, 0)))
    assert [cap.k(b) for b in (1, 2, 3, 4, 16)] == [None, 2, 2, 0, 0]
    assert [LoadCap().k(b) for b in (1, 4, 7, 8, 32)] == [None, None, None, 0, 0]  # measured default
    rules = [StoppingRules.build(b) for b in BUDGETS]
    truth = solo(target, rules)
    for rows, most in ((1, 6), (2, 2), (4, 0)):
        engine = SpeculativeEngine(target, make(), ConstantK(6), spawn=make, load_cap=cap)
        results = engine.generate_batch(SequenceSpec.batch(PROMPTS[:rows], rules[:rows]))
        assert [r.token_ids for r in results] == truth[:rows]
        assert max(s.num_drafted for r in results for s in r.steps[:3]) == most


def test_bad_batches_are_refused_before_any_work(target):
    """The request checks a batch (the engine takes its specs as checked); an engine without
    `spawn` refuses a second sequence with nothing left running."""
    loaded = LoadedModel(target, None, "tiny")
    with pytest.raises(VerispecError, match="outside the vocabulary"):
        build_request(loaded, [[1, 2], [1, VOCAB + 3]], max_new_tokens=4)
    with pytest.raises(VerispecError, match="empty"):
        build_request(loaded, [[1, 2], []], max_new_tokens=4)
    with pytest.raises(VerispecError, match="number of sequences") as refused:
        build_request(loaded, [[1, 2]], sequences=0)
    assert refused.value.field == "sequences"
    make = lambda: PromptLookupDrafter(3, 1)  # noqa: E731
    lonely = SpeculativeEngine(target, make(), ConstantK(4))  # no spawn: one sequence only
    with pytest.raises(VerispecError, match="cannot be copied"):
        lonely.generate_batch(SequenceSpec.batch(PROMPTS[:2], StoppingRules.build(4)))
    assert not lonely.active


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


@pytest.mark.slow  # 20 s; the default suite keeps tests/test_greedy_equality.py's many calls
def test_memory_is_flat_over_200_batched_calls(target):
    """After warm-up, 200 more batched calls grow the resident set by less than 8 MiB."""
    draft = tiny_llama(seed=7, layers=1)  # one model, a drafter (and cache) per row
    make = lambda: ModelDrafter(draft, VOCAB)  # noqa: E731
    engine = SpeculativeEngine(target, make(), ConstantK(3), spawn=make)
    rules = StoppingRules.build(8, EOS)

    def call():
        engine.generate_batch(SequenceSpec.batch(PROMPTS, rules, SamplingParams(do_sample=True), seed=1))

    for _ in range(20):
        call()
    before = _rss_mib()
    for _ in range(200):
        call()
    assert _rss_mib() - before < 8
    assert len(engine._free[engine.speculation]) == len(PROMPTS)


def test_sequences_of_one_batch_may_each_speculate_their_own_way(tmp_path):
    """A server's requests name their methods: rows drafting differently share target passes."""
    loaded = load_model(str(save_tiny(tmp_path, seed=0)))
    rules = [StoppingRules.build(b) for b in BUDGETS]
    truth = solo(loaded.model, rules)
    engine = build_engine(loaded, "ar")
    ways = [build_speculation(loaded, "pld", DraftOptions(k=4)), None,
            build_speculation(loaded, "self-int4", DraftOptions(k=3)),
            build_speculation(loaded, "pld", DraftOptions(tree="default"))]
    ids = [engine.add(SequenceSpec(p, r), speculation=way)[0] for p, r, way in zip(PROMPTS, rules, ways)]
    got: dict[int, list] = {i: [] for i in ids}
    while engine.active:
        for row_id, step in engine.step():
            got[row_id].append(step)
    assert [[t for s in got[i] for t in s.tokens] for i in ids] == truth
    assert all(s.num_drafted == 0 for s in got[ids[1]])
    assert any(s.num_drafted > 0 for s in got[ids[2]])
