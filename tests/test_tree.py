"""Token trees: masks and positions, tree forwards and KV compaction, greedy tree verification."""

from __future__ import annotations

import random

import pytest
import torch

from tests.drafters import RandomDrafter, TreeOracleDrafter
from tests.tiny import VOCAB, plain_greedy
from verispec.core.errors import VerispecError
from verispec.core.policies import ConstantK
from verispec.core.stopping import StoppingRules
from verispec.core.tree import attention_mask, chain_parents, check_parents, is_chain, position_ids
from verispec.core.types import Proposal
from verispec.decoding.engine import SpeculativeEngine
from verispec.decoding.sequence import SequenceSpec
from verispec.model.cached_model import CachedModel
from verispec.verifiers import greedy_accept
from verispec.verifiers.tree import greedy_tree_accept

NEW = 40
PROMPT = [1, 17, 42, 9, 33, 17, 42, 5]


def random_tree(rng: random.Random, size: int) -> list[int]:
    """Parents of a random topologically ordered tree: each node under the root or a node before it."""
    return [rng.randrange(-1, i) for i in range(size)]


def reference_ancestors(parents: list[int], node: int) -> set[int]:
    """Block rows node `node` may see: itself, its ancestors by following parents, and the root."""
    seen = {node + 1, 0}
    while parents[node] != -1:
        node = parents[node]
        seen.add(node + 1)
    return seen


def test_mask_and_positions_match_a_simple_reference_over_200_random_trees():
    rng = random.Random(0)
    for trial in range(200):
        size, past, padding = rng.randint(1, 40), rng.randint(0, 12), rng.randint(0, 3)
        parents = random_tree(rng, size)
        mask = attention_mask(torch.tensor(parents), past, padding)[0, 0]
        positions = position_ids(torch.tensor(parents), past, padding)
        rows = size + 1 + padding
        assert mask.shape == (rows, past + rows) and positions.shape == (rows,)
        assert mask[:, :past].all(), "every row sees the whole committed context"
        assert mask[0, past:].tolist() == [True] + [False] * (rows - 1), "the root sees only itself"
        for node in range(size):
            visible = {col - past for col in mask[node + 1].nonzero().flatten().tolist() if col >= past}
            assert visible == reference_ancestors(parents, node), f"trial {trial}, node {node}"
            depth = len(reference_ancestors(parents, node)) - 1
            assert positions[node + 1] == past + depth
            for sibling in range(size):
                if sibling != node and parents[sibling] == parents[node]:
                    assert not mask[node + 1, past + sibling + 1], "siblings never see each other"
        for pad in range(size + 1, rows):  # padding sees the context and itself only
            assert mask[pad, past:].nonzero().flatten().tolist() == [pad]


def test_a_chain_is_the_causal_mask_and_is_recognised():
    mask = attention_mask(chain_parents(5), past=3)[0, 0]
    assert torch.equal(mask, torch.ones(6, 9, dtype=torch.bool).tril(3))
    assert torch.equal(position_ids(chain_parents(5), 3), torch.arange(3, 9))
    assert is_chain(None) and is_chain(chain_parents(4)) and not is_chain(torch.tensor([-1, -1]))


def test_invalid_parents_are_refused():
    for bad in ([0], [-1, 2], [-2], [-1, 1]):
        with pytest.raises(VerispecError, match="parents"):
            check_parents(torch.tensor(bad))


def test_tree_forward_equals_each_branch_run_as_a_sequence_and_compaction_keeps_the_path(target):
    rng = random.Random(1)
    context = torch.tensor(PROMPT)
    for trial in range(10):
        parents = random_tree(rng, rng.randint(2, 14))
        tokens = torch.randint(3, VOCAB, (len(parents),), generator=torch.Generator().manual_seed(trial))
        model = CachedModel(target)
        model.forward(context[:-1])
        logits, _ = model.forward_hidden(torch.cat([context[-1:], tokens]), torch.tensor(parents))
        assert model.length == len(PROMPT) + len(parents)
        leaf = rng.randrange(len(parents))
        path = sorted(r - 1 for r in reference_ancestors(parents, leaf) if r > 0)
        sequence = CachedModel(target)
        expected = sequence.forward(torch.cat([context, tokens[path]]))  # [len + path, vocab]
        rows = [0] + [node + 1 for node in path]
        torch.testing.assert_close(logits[rows], expected[len(PROMPT) - 1:], atol=1e-5, rtol=1e-5)
        # After compaction the cache holds context + path: the next token scores as in a sequence.
        model.keep(len(PROMPT) - 1, rows)
        assert model.length == len(PROMPT) + len(path)
        torch.testing.assert_close(model.forward(torch.tensor([11])), sequence.forward(torch.tensor([11])),
                                   atol=1e-5, rtol=1e-5)


def test_greedy_tree_accept_worked_example_and_agreement_with_the_chain_rule():
    logits = torch.full((4, 10), -1.0)
    for row, best in enumerate([5, 2, 6, 9]):
        logits[row, best] = 1.0
    assert greedy_tree_accept(torch.tensor([4, 5, 6]), torch.tensor([-1, -1, 0]), logits) == ([1], 6)
    assert greedy_tree_accept(torch.tensor([5, 7, 6]), torch.tensor([-1, 0, 0]), logits) == ([0], 2)
    gen = torch.Generator().manual_seed(0)
    for k in range(1, 10):
        draft = torch.randint(0, 4, (k,), generator=gen)
        scores = torch.randn(k + 1, 4, generator=gen)
        n, token = greedy_accept(draft, scores)
        assert greedy_tree_accept(draft, chain_parents(k), scores) == (list(range(n)), token)


@pytest.mark.parametrize("depth", list(range(1, 17)))
def test_greedy_tree_verification_matches_plain_decoding(target, depth):
    truth = plain_greedy(target, PROMPT, NEW)
    for width in (2, 4):
        for errors in (set(), {0, 3, 4, 11, 12, 13, 30}):
            drafter = TreeOracleDrafter(len(PROMPT), truth, errors, VOCAB, width, seed=depth)
            result = SpeculativeEngine(target, drafter, ConstantK(depth)).generate(
                SequenceSpec(PROMPT, StoppingRules.build(NEW)))
            assert result.token_ids == truth, f"width {width}, errors {errors}"
            assert result.stats.new_tokens == NEW == len(result.token_ids)
            if not errors and depth > 1:
                assert result.stats.mean_accepted_tokens > min(depth, 4) * 0.8
            assert all(step.tree is not None for step in result.steps if step.num_drafted)


class RandomTreeDrafter(RandomDrafter):
    def propose(self, request):
        chain = super().propose(request).tokens
        parents = torch.tensor(random_tree(random.Random(len(request.tokens)), len(chain)))
        return Proposal(chain, parents=parents)


def test_a_random_tree_is_almost_never_accepted_and_still_exact(target):
    truth = plain_greedy(target, PROMPT, NEW)
    result = SpeculativeEngine(target, RandomTreeDrafter(VOCAB), ConstantK(8)).generate(
        SequenceSpec(PROMPT, StoppingRules.build(NEW)))
    assert result.token_ids == truth
    assert result.stats.mean_accepted_tokens < 1.5


def test_acceptance_by_position_counts_tree_depth(target):
    truth = plain_greedy(target, PROMPT, NEW)
    drafter = TreeOracleDrafter(len(PROMPT), truth, set(), VOCAB, width=3)
    result = SpeculativeEngine(target, drafter, ConstantK(4)).generate(
        SequenceSpec(PROMPT, StoppingRules.build(NEW)))
    rates = result.stats.acceptance_by_position
    assert len(rates) == 4 and min(rates) > 0.8  # 4 levels of 3+ nodes each: positions are levels


def test_a_drafter_with_a_malformed_tree_gets_a_clear_error(target):
    class BadTree(RandomDrafter):
        def propose(self, request):
            return Proposal(super().propose(request).tokens, parents=torch.tensor([1, -1, 0, 0])[: request.k])

    with pytest.raises(VerispecError, match="parents"):
        SpeculativeEngine(target, BadTree(VOCAB), ConstantK(4)).generate(
            SequenceSpec(PROMPT, StoppingRules.build(8)))
