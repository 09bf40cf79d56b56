"""How drafters shape trees: EAGLE-2 growth, Medusa's static tree, prompt lookup's trie."""

from __future__ import annotations

import random

import torch

from verispec.core.tree import TreeSettings, check_parents, depths, grow_tree
from verispec.drafters.medusa import static_tree
from verispec.drafters.ngram import find_continuations, trie

VOCAB = 12


def toy_logp(tokens: torch.Tensor) -> torch.Tensor:
    """A fixed 'drafter': child log-probabilities depend on the parent token. [m] -> [m, VOCAB]."""
    table = torch.randn(VOCAB, VOCAB, generator=torch.Generator().manual_seed(0)) * 2
    return table[tokens].log_softmax(-1)


def test_grown_trees_are_valid_and_keep_the_most_probable_nodes():
    rng = random.Random(0)
    for _ in range(50):
        depth, settings = rng.randint(1, 6), TreeSettings(rng.randint(1, 5), rng.randint(1, 30))
        root = torch.randn(VOCAB, generator=torch.Generator().manual_seed(rng.randrange(99)))
        scores: dict[int, float] = {}

        def expand(nodes, parents, tokens):
            assert all(parents[node] < node for node in nodes)
            return toy_logp(tokens)

        tokens, parents = grow_tree(root.log_softmax(-1), expand, depth, settings)
        check_parents(parents)
        assert 1 <= len(tokens) <= settings.nodes
        assert int(depths(parents).max()) <= depth
        # The path log-probability of every kept node, recomputed from the toy drafter.
        for i, parent in enumerate(parents.tolist()):
            before = root.log_softmax(-1) if parent == -1 else toy_logp(tokens[parent:parent + 1])[0]
            scores[i] = (0.0 if parent == -1 else scores[parent]) + float(before[tokens[i]])
        assert max(scores.values()) == float(root.log_softmax(-1).max())
        # Children never beat their parents, so no kept node lacks its parent (check_parents).
        assert all(scores[i] <= scores[p] + 1e-6 for i, p in enumerate(parents.tolist()) if p >= 0)


def test_static_tree_is_best_first_and_prefix_closed():
    assert static_tree([[0.6, 0.2], [0.5, 0.1]], 3) == [(0,), (0, 0), (1,)]
    rng = random.Random(1)
    for _ in range(50):
        heads, ranks = rng.randint(1, 5), rng.randint(1, 6)
        accuracy = [sorted((rng.random() / ranks for _ in range(ranks)), reverse=True)
                    for _ in range(heads)]
        chosen = static_tree(accuracy, rng.randint(1, 40))
        assert len(set(chosen)) == len(chosen)
        assert all(path[:-1] in chosen for path in chosen if len(path) > 1)


def test_prompt_lookup_finds_recent_matches_and_merges_them_into_a_trie():
    tokens = torch.tensor([1, 2, 3, 9, 1, 2, 4, 7, 1, 2, 3, 5, 1, 2])
    assert find_continuations(tokens, 3, 2, 1) == [[3, 5, 1]]
    assert find_continuations(tokens, 3, 2, 1, count=3) == [[3, 5, 1], [4, 7, 1], [3, 9, 1]]
    assert trie([[5, 6, 7], [5, 8]], 10) == ([5, 6, 7, 8], [-1, 0, 1, 0])
    assert trie([[3, 5, 1], [4, 7, 1], [3, 9, 1]], 5) == ([3, 5, 1, 4, 7], [-1, 0, 1, -1, 3])
    assert find_continuations(torch.tensor([1, 2, 3]), 4, 2, 1) == []
