"""Prompt lookup decoding (Saxena 2023): copy what followed the last n-gram's earlier occurrence."""

from __future__ import annotations

import torch

from verispec.core.errors import VerispecError
from verispec.core.tree import TreeSettings
from verispec.core.types import Proposal
from verispec.drafters.base import Drafter, DraftRequest


def find_continuations(tokens: torch.Tensor, k: int, max_ngram: int, min_ngram: int,
                       count: int = 1) -> list[list[int]]:
    """What followed earlier occurrences of the context's last n-gram, most recent first.

    tokens: [n]. Tries n-gram sizes from max_ngram down to min_ngram and collects up to `count`
    distinct continuations of up to k tokens (none when nothing matches).

    Example: tokens [1 2 3 9 1 2], n = 2: "1 2" occurred at 0, followed by [3 9 1 2] -> first k.
    """
    length = tokens.shape[0]
    found: list[list[int]] = []
    for n in range(min(max_ngram, length - 1), min_ngram - 1, -1):
        windows = tokens[:-1].unfold(0, n, 1)  # [length - n, n]: every earlier n-gram
        for start in ((windows == tokens[-n:]).all(-1).nonzero().flatten() + n).flip(0).tolist():
            continuation = tokens[start:start + k].tolist()
            if continuation not in found:
                found.append(continuation)
                if len(found) == count:
                    return found
    return found


def trie(continuations: list[list[int]], max_nodes: int) -> tuple[list[int], list[int]]:
    """Merge token sequences into a tree sharing common prefixes: (tokens, parents), at most
    max_nodes nodes, earlier sequences first.

    Example: [[5, 6, 7], [5, 8]] -> tokens [5, 6, 7, 8], parents [-1, 0, 1, 0].
    """
    tokens: list[int] = []
    parents: list[int] = []
    node_of: dict[tuple[int, int], int] = {}  # (parent, token) -> node
    for sequence in continuations:
        parent = -1
        for token in sequence:
            if (parent, token) not in node_of:
                if len(tokens) == max_nodes:
                    break
                node_of[parent, token] = len(tokens)
                tokens.append(token)
                parents.append(parent)
            parent = node_of[parent, token]
    return tokens, parents


class PromptLookupDrafter(Drafter):
    """Deterministic and stateless: its q is one-hot, so it reports draft_probs=None. With `tree`
    settings it drafts the trie of the `tree.topk` most recent distinct matches (`tree.nodes`
    nodes at most) instead of the most recent match alone."""

    forks = True  # stateless: nothing to copy or cut

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1, tree: TreeSettings | None = None) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise VerispecError(
                f"n-gram sizes must satisfy 1 <= min ({min_ngram}) <= max ({max_ngram})")
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram
        self.tree = tree

    def copy_from(self, other: Drafter) -> None:
        pass

    def truncate(self, length: int) -> None:
        pass

    def propose(self, request: DraftRequest) -> Proposal:
        count = 1 if self.tree is None else self.tree.topk
        found = find_continuations(request.tokens, request.k, self.max_ngram, self.min_ngram, count)
        if self.tree is None or len(found) < 2:
            return Proposal(torch.tensor(found[0] if found else [], dtype=torch.int64,
                                         device=request.tokens.device))
        tokens, parents = trie(found, self.tree.nodes)
        device = request.tokens.device
        return Proposal(torch.tensor(tokens, device=device), parents=torch.tensor(parents, device=device))
