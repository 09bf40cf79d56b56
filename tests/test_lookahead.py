"""Lookahead decoding: the side branch's mask, greedy equality, exact sampling, state and input."""

from __future__ import annotations

import pytest
import torch

import verispec
import verispec.verifiers.tree as tree_verifier
from tests.distribution import FAST_SKEW, POWER, check_laws
from tests.test_tree_sampling import P0, TABLE, V, trials
from tests.tiny import plain_greedy, tiny_foreign
from verispec.core.errors import VerispecError
from verispec.core.policies import ConstantK, HeuristicK
from verispec.core.sampling import sample
from verispec.core.stopping import StoppingRules
from verispec.core.tree import side_block
from verispec.core.types import SamplingParams
from verispec.decoding.engine import SpeculativeEngine
from verispec.decoding.sequence import SequenceSpec
from verispec.drafters.base import DraftRequest
from verispec.drafters.lookahead import LookaheadDrafter, lookahead_branch
from verispec.methods import build_engine
from verispec.options import DraftOptions
from verispec.verifiers.tree import tree_rejection_sample

NEW = 40
PROMPTS = [[1, 17, 42, 9, 33, 17, 42, 5], [1, 60]]
# (W, N, G, k): from the smallest window and shortest n-grams to wide ones cut by a small k.
SETTINGS = [(1, 2, 1, 1), (2, 3, 2, 2), (5, 4, 5, 3), (4, 5, 8, 4), (3, 4, 3, 2), (8, 8, 12, 16)]


def test_side_block_puts_the_side_rows_after_the_tree():
    """side_block's docstring example, and a draft that never sees the side rows."""
    mask, positions = side_block(torch.tensor([-1]), torch.tensor([[1, 0, 1, 0], [1, 0, 1, 1]]).bool(),
                                 torch.tensor([1, 2]), past=5, padding=1)
    assert positions.tolist() == [5, 6, 6, 7, 8]
    block = mask[0, 0, :, 5:].int().tolist()
    assert block == [[1, 0, 0, 0, 0],   # root
                     [1, 1, 0, 0, 0],   # node 0
                     [1, 0, 1, 0, 0],   # side 0
                     [1, 0, 1, 1, 0],   # side 1
                     [0, 0, 0, 0, 1]]   # padding: the context and itself
    assert mask[0, 0, :, :5].all()
    with pytest.raises(VerispecError, match="needs a mask of shape"):
        side_block(torch.tensor([-1]), torch.ones(2, 3, dtype=torch.bool), torch.tensor([1, 2]), 5)


def test_lookahead_window_sees_the_run_it_continues():
    """lookahead_branch's docstring example, after a draft of one node the window never sees."""
    offsets, mask = lookahead_branch(levels=2, window=2, num_draft=1)
    assert offsets.tolist() == [1, 2, 2, 3]  # a0 a1 b0 b1
    assert mask.int().tolist() == [[1, 0, 1, 0, 0, 0],   # a0: root, a0
                                   [1, 0, 1, 1, 0, 0],   # a1: root, a0, a1
                                   [1, 0, 1, 0, 1, 0],   # b0: root, a0, b0
                                   [1, 0, 1, 1, 0, 1]]   # b1: root, a0, a1, b1
    # Every guess sees one token per offset 1 .. its own: a consistent sequence.
    offsets, mask = lookahead_branch(levels=3, window=4, num_draft=0)
    for row in range(12):
        seen = offsets[mask[row, 1:]].sort().values
        assert seen.tolist() == list(range(1, int(offsets[row]) + 1))


@pytest.fixture(scope="module")
def references(target):
    return [plain_greedy(target, p, NEW) for p in PROMPTS]


@pytest.mark.parametrize("window, ngram, guesses, k", SETTINGS)
def test_lookahead_matches_plain_decoding(target, references, window, ngram, guesses, k):
    for prompt, truth in zip(PROMPTS, references):
        for pool_context in (False, True):
            engine = SpeculativeEngine(target, LookaheadDrafter(window, ngram, guesses, pool_context),
                                       ConstantK(k))
            length = len(prompt)
            steps = []
            for step in engine.steps(SequenceSpec(prompt, StoppingRules.build(NEW))):
                length += len(step.tokens)
                assert engine.target.length == length - 1  # the side rows never stay cached
                steps.append(step)
            assert [t for s in steps for t in s.tokens] == truth, (window, ngram, guesses, k, pool_context)
    # The pool does its work: more than one token per target forward on the repetitive prompt.
    result = SpeculativeEngine(target, LookaheadDrafter(5, 4, 5), ConstantK(3)).generate(
        SequenceSpec(PROMPTS[0], StoppingRules.build(NEW)))
    assert result.stats.mean_accepted_tokens > 1.5


def test_lookahead_off_the_lean_path_and_with_a_varying_k_matches_plain_decoding(target, references):
    model = tiny_foreign(seed=3)  # through Hugging Face's own forward, blocks padded to 4 rows
    for prompt in PROMPTS:
        truth = plain_greedy(model, prompt, NEW)
        for window, ngram, guesses, k in SETTINGS[1:4]:
            engine = SpeculativeEngine(model, LookaheadDrafter(window, ngram, guesses), ConstantK(k))
            assert engine.target.lean is None
            assert engine.generate(SequenceSpec(prompt, StoppingRules.build(NEW))).token_ids == truth
    engine = SpeculativeEngine(target, LookaheadDrafter(4, 5, 4), HeuristicK(2))
    assert engine.generate(SequenceSpec(PROMPTS[0], StoppingRules.build(NEW))).token_ids == references[0]


def test_no_state_leaks_across_calls(target, references):
    drafter = LookaheadDrafter(4, 4, 4, pool_context=True)
    engine = SpeculativeEngine(target, drafter, ConstantK(3))
    first = engine.generate(SequenceSpec(PROMPTS[0], StoppingRules.build(NEW)))
    assert any(step.num_accepted for step in first.steps)  # the pool drafted, and drafts were kept
    assert not drafter.pool and not drafter.levels  # a finished sequence's drafter is emptied
    other = engine.generate(SequenceSpec(PROMPTS[1], StoppingRules.build(NEW)))
    again = engine.generate(SequenceSpec(PROMPTS[0], StoppingRules.build(NEW)))
    assert other.token_ids == references[1] and again.token_ids == references[0]
    assert [len(s.tokens) for s in again.steps] == [len(s.tokens) for s in first.steps]
    drafter.reset()
    assert not drafter.pool and not drafter.levels and drafter.absorbed == 0


@pytest.mark.parametrize("kwargs, message", [
    ({"window": 0}, "window W must be an integer >= 1"),
    ({"ngram": 1}, "n-gram size N must be an integer >= 2"),
    ({"guesses": -1}, "guesses G must be an integer >= 0"),
    ({"window": 2.5}, "window W must be an integer"),
])
def test_bad_settings_are_refused(kwargs, message):
    with pytest.raises(VerispecError, match=message):
        LookaheadDrafter(**{"window": 2, "ngram": 3, "guesses": 2} | kwargs)


def test_options_reach_the_drafter_and_are_checked_first(tiny_dir):
    target = verispec.load(str(tiny_dir))
    drafter = build_engine(target, "lookahead", DraftOptions(k=2, lookahead_window=3)).drafter
    assert (drafter.window, drafter.ngram, drafter.guesses, drafter.pool_context) == (
        3, 3, DraftOptions.lookahead_guesses, DraftOptions.lookahead_pool_context)
    drafter = build_engine(target, "lookahead", DraftOptions(lookahead_ngram=6)).drafter
    assert drafter.ngram == 6
    with pytest.raises(VerispecError, match="n-gram size N"):
        verispec.generate(target, "w10 w11", method="lookahead", max_new_tokens=4,
                          options=DraftOptions(lookahead_ngram=1))
    result = verispec.generate(target, "w10 w11 w10 w11", method="lookahead", max_new_tokens=12,
                               options=DraftOptions(lookahead_window=2, lookahead_guesses=3))
    assert result.token_ids == verispec.generate(target, "w10 w11 w10 w11", max_new_tokens=12).token_ids


# Sampling: the draft is the pooled n-grams after the root, a deterministic proposal (q one-hot),
# verified by exact tree rejection sampling. With a known two-step target (P0 for the first token,
# TABLE[t1] for the second) the first two emitted tokens must follow P0(t1) * TABLE[t1](t2).
ROOT = 7
# Tails sharing first tokens (merged into one branch); the second p0 gives two candidates no mass.
TAILS = [(0, 1), (0, 2), (1, 3), (2, 5), (5, 0)]


def lookahead_proposal() -> tuple[torch.Tensor, torch.Tensor]:
    """The draft tree a lookahead drafter makes from a pool holding TAILS after ROOT."""
    drafter = LookaheadDrafter(2, 3, len(TAILS))
    for tail in TAILS:
        drafter._remember(ROOT, tail)
    proposal = drafter.propose(DraftRequest(torch.tensor([ROOT]), 2, SamplingParams(do_sample=True), None))
    assert proposal.draft_probs is None and len(proposal) == 9  # 4 first tokens, 5 second
    return proposal.tokens, proposal.parents


def lookahead_tvs(p0: torch.Tensor, skew: float) -> list[str]:
    """What is wrong with the first token's law and the first two's over the tree sampling tests'
    number of draws (power 0.99 against `skew`)."""
    tokens, parents = lookahead_proposal()
    uniform = torch.full((V,), 1.0 / V)  # after a second token: the bonus, not looked at here
    target = torch.stack([p0] + [TABLE[t] if parent == -1 else uniform
                                 for t, parent in zip(tokens.tolist(), parents.tolist())])  # [1 + N, V]
    gen = torch.Generator().manual_seed(0)
    counts = torch.zeros(V, V, dtype=torch.float64)
    n = trials(skew)
    for _ in range(n):
        path, next_token = tree_rejection_sample(tokens, parents, None, target, gen)
        emitted = [int(tokens[i]) for i in path] + [next_token]
        if len(emitted) == 1:  # the next step's plain sample
            emitted.append(int(sample(TABLE[emitted[0]], gen)))
        counts[emitted[0], emitted[1]] += 1
    empirical = counts / n
    exact = p0.double()[:, None] * TABLE.double()
    return check_laws([("first token", empirical.sum(1), p0.double()),
                       ("first two", empirical.flatten(), exact.flatten())], n, skew)


@pytest.mark.parametrize("p0", [P0, torch.tensor([0.0, 0.0, 0.1, 0.0, 0.2, 0.7])])
@pytest.mark.parametrize("skew", POWER)
def test_sampling_through_the_lookahead_tree_emits_the_target_distribution(p0, skew):
    assert lookahead_tvs(p0, skew) == []


def test_the_sampling_check_catches_candidates_tried_against_the_original_target(monkeypatch):
    monkeypatch.setattr(tree_verifier, "residual", lambda target, draft: target)
    assert any(problem.startswith("first token: TV") for problem in lookahead_tvs(P0, FAST_SKEW))


def test_seeded_sampling_repeats(target):
    engine = SpeculativeEngine(target, LookaheadDrafter(3, 3, 3), ConstantK(2))
    sampling = SamplingParams(do_sample=True, temperature=0.8)

    def tokens(seed: int) -> list[int]:
        return engine.generate(SequenceSpec(PROMPTS[0], StoppingRules.build(24), sampling, seed)).token_ids

    assert tokens(1) == tokens(1) and tokens(1) != tokens(2)


def test_builtin_model_lookahead_is_exact():
    smollm = verispec.load("smollm2-135m-instruct")
    prompt = verispec.request.encode_prompt(smollm, "Repeat after me: one two three, one two three.",
                                            chat=True)
    reference = verispec.generate(smollm, prompt, max_new_tokens=24).token_ids
    for options in (DraftOptions(), DraftOptions(k=2, lookahead_window=3, lookahead_pool_context=True)):
        result = build_engine(smollm, "lookahead", options).generate(
            SequenceSpec(prompt, StoppingRules.build(24, smollm.eos_token_ids)))
        assert result.token_ids == reference[: len(result.token_ids)]
        assert len(result.token_ids) == len(reference)
