"""Token trees as data: a parent index per draft node, from which masks and positions follow.

A proposal of N draft nodes is verified in one target forward over the block [root, node 0, ...,
node N-1], where the root is the last committed token. parents[i] is the index of node i's parent
(-1 for a child of the root) and is always < i, so the nodes are in topological order. A chain of
k tokens is the tree with parents [-1, 0, 1, ..., k-2]. Every node sees the committed context, the
root, its ancestors and itself, and sits at position context + depth: siblings never see each
other, and a branch looks to the model exactly like the sequence it stands for.

Example: parents [-1, -1, 0] is the root with children 0 and 1, and node 2 under node 0:

        root            block row: 0 = root, 1 + i = node i
        /  \\            depth:     root 0, nodes [1, 1, 2]
       0    1           node 2 sees rows {0, 1, 3}: root, node 0, itself
       |
       2
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from verispec.core.errors import VerispecError


def chain_parents(n: int, device: torch.device | str | None = None) -> torch.Tensor:
    """The parents of a chain of n nodes: [-1, 0, ..., n-2]. Returns [n] int64."""
    return torch.arange(-1, n - 1, device=device)


def check_parents(parents: torch.Tensor) -> None:
    """Raise unless parents [N] is a valid topologically ordered tree (-1 <= parents[i] < i)."""
    index = torch.arange(parents.shape[0], device=parents.device)
    if parents.dim() != 1 or bool(((parents < -1) | (parents >= index)).any()):
        raise VerispecError(f"tree parents must satisfy -1 <= parents[i] < i, got {parents.tolist()}")


def is_chain(parents: torch.Tensor | None) -> bool:
    """True when every node is the child of the one before it (or there is no tree at all)."""
    if parents is None:
        return True
    return bool((parents == chain_parents(parents.shape[0], parents.device)).all())


def ancestor_mask(parents: torch.Tensor) -> torch.Tensor:
    """mask[a, b] is True when block row b is row a or one of its ancestors.

    parents: [N]. Returns [N + 1, N + 1] bool over block rows (row 0 = root, row 1 + i = node i).
    """
    n = parents.shape[0]
    mask = torch.eye(n + 1, dtype=torch.bool, device=parents.device)
    mask[:, 0] = True
    for i, parent in enumerate(parents.tolist()):  # parents come first: their rows are complete
        mask[i + 1] |= mask[parent + 1]
    return mask


def depths(parents: torch.Tensor) -> torch.Tensor:
    """Depth of every block row (root 0, a child of the root 1, ...). parents [N] -> [N + 1]."""
    return ancestor_mask(parents).sum(-1) - 1


def attention_mask(parents: torch.Tensor, past: int, padding: int = 0) -> torch.Tensor:
    """Boolean attention mask for a tree block fed after `past` cached tokens (True = attend).

    parents: [N]. Returns [1, 1, N + 1 + padding, past + N + 1 + padding]. Padding rows (appended
    by the caller for faster matrix shapes) see the context and themselves only.
    """
    n = parents.shape[0] + 1 + padding
    mask = torch.zeros(n, past + n, dtype=torch.bool, device=parents.device)
    mask[:, :past] = True
    mask[:, past:] = torch.eye(n, dtype=torch.bool, device=parents.device)
    mask[: n - padding, past: past + n - padding] = ancestor_mask(parents)
    return mask[None, None]


def position_ids(parents: torch.Tensor, past: int, padding: int = 0) -> torch.Tensor:
    """Positions of a tree block's rows: past + depth; padding rows follow the deepest row.

    parents: [N]. Returns [N + 1 + padding] int64.
    """
    positions = past + depths(parents)
    extra = positions.max() + 1 + torch.arange(padding, device=parents.device)
    return torch.cat([positions, extra])


def side_block(parents: torch.Tensor, side_mask: torch.Tensor, side_offsets: torch.Tensor,
               past: int, padding: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Mask and positions of a block [root, N draft nodes, m side tokens, padding] fed after `past`
    cached tokens: the tree part as attention_mask / position_ids give it (it never sees the side
    rows), then the side rows, which see the context and the block rows side_mask allows, at
    past + offset (see verispec.core.types.SideBranch).

    parents: [N]; side_mask: [m, N + 1 + m] bool; side_offsets: [m]. Returns the mask
    [1, 1, n, past + n] and positions [n], n = N + 1 + m + padding.

    Example: parents [-1] (one node), past 5, two side tokens at offsets [1, 2], each seeing the
    root and the side tokens up to itself, side_mask [[1, 0, 1, 0], [1, 0, 1, 1]]: block rows
    root, node, s0, s1 sit at positions [5, 6, 6, 7]; the node sees {root, node}, s1 sees
    {root, s0, s1}, and every row sees the 5 cached tokens.
    """
    nodes, m = parents.shape[0], side_offsets.shape[0]
    if side_mask.shape != (m, nodes + 1 + m):
        raise VerispecError(f"a side branch of {m} tokens after {nodes} draft nodes needs a mask of "
                            f"shape ({m}, {nodes + 1 + m}), got {tuple(side_mask.shape)}")
    mask = attention_mask(parents, past, m + padding)[0, 0]  # side rows start as padding rows
    mask[nodes + 1: nodes + 1 + m, past: past + nodes + 1 + m] = side_mask
    positions = torch.cat([position_ids(parents, past), past + side_offsets.to(parents.device)])
    extra = positions.max() + 1 + torch.arange(padding, device=parents.device)
    return mask[None, None], torch.cat([positions, extra])


def children(parents: list[int]) -> list[list[int]]:
    """children[r] = the nodes under block row r (row 0 = root), in proposal order."""
    kids: list[list[int]] = [[] for _ in range(len(parents) + 1)]
    for i, parent in enumerate(parents):
        kids[parent + 1].append(i)
    return kids


def subtree_parents(parents: list[int], keep: list[int]) -> list[int]:
    """Re-index a tree restricted to the nodes `keep` (ancestor-closed, in topological order)."""
    where = {old: new for new, old in enumerate(keep)}
    return [-1 if parents[old] == -1 else where[parents[old]] for old in keep]


@dataclass(frozen=True)
class TreeSettings:
    """Shape of a drafted tree: `topk` children per expanded node (and nodes expanded per level),
    `nodes` draft nodes kept in all; the depth is the step's draft length k."""

    topk: int = 4
    nodes: int = 16

    def __post_init__(self) -> None:
        if self.topk < 1 or self.nodes < 1:
            raise VerispecError(f"tree top-k and node count must be >= 1, got {self.topk}, {self.nodes}")


# expand(nodes, parents, tokens): log-probabilities [len(nodes), vocab] of the children of `nodes`
# (indices into the tree grown so far, whose parents are `parents`; tokens [len(nodes)] theirs).
Expand = Callable[[list[int], list[int], torch.Tensor], torch.Tensor]


def grow_tree(root_logp: torch.Tensor, expand: Expand, depth: int,
              settings: TreeSettings) -> tuple[torch.Tensor, torch.Tensor]:
    """EAGLE-2's dynamic tree (Li et al. 2024): grow by confidence, rerank, keep the best nodes.

    root_logp: [vocab], the drafter's log-probabilities for the first draft token. Level 1 holds
    the root's top-k tokens; each further level expands the top-k nodes of the level before (by
    path log-probability, the sum along the path) and gives each its top-k children. At the end
    the `nodes` most probable nodes are kept: a path's log-probability never grows along it, so
    the kept set holds every kept node's ancestors (ties go to the shallower node).
    Returns (tokens [N] int64 in root_logp's vocabulary, parents [N]), in topological order.
    """
    tokens: list[torch.Tensor] = []  # one [m] tensor per level
    scores: list[torch.Tensor] = []  # path log-probabilities, one [m] tensor per level
    parents: list[int] = []
    top = root_logp.topk(min(settings.topk, root_logp.shape[-1]))
    tokens.append(top.indices)
    scores.append(top.values)
    parents += [-1] * top.indices.shape[0]
    level_start = 0
    for _ in range(depth - 1):
        level = scores[-1]
        chosen = level.topk(min(settings.topk, level.shape[0])).indices  # [m]
        nodes = (chosen + level_start).tolist()
        logp = expand(nodes, parents, tokens[-1][chosen])  # [m, vocab]
        children = (level[chosen, None] + logp).topk(min(settings.topk, logp.shape[-1]), dim=-1)
        level_start = len(parents)
        parents += [node for node in nodes for _ in range(children.indices.shape[1])]
        tokens.append(children.indices.flatten())
        scores.append(children.values.flatten())
    all_tokens = torch.cat(tokens)
    ranked = [(-score, level) for level, row in enumerate(scores) for score in row.tolist()]
    # Rank by score, then shallower first; keep the best, in creation (= topological) order.
    rank = sorted(range(len(parents)), key=ranked.__getitem__)
    keep = sorted(rank[: settings.nodes])
    return all_tokens[keep], torch.tensor(subtree_parents(parents, keep), device=root_logp.device)
