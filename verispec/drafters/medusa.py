"""Medusa-1 heads (Cai et al. 2024): K residual heads on the target's last hidden state.

Head k reads the hidden state h_i of the last position the target has scored (whose own LM head
output is the newest committed token x_{i+1}) and predicts x_{i+1+k}, as
softmax(W_head · (h_i + SiLU(W_k h_i + b_k))). W_k starts at zero; W_head is the target's own
LM head, frozen and shared by every head (restricted to a frequency-ranked vocabulary, see
ReducedHead), so each head adds only hidden² + hidden weights. The heads draft a chain (top-1
per head) or a static tree over each head's top tokens (`static_tree`); all heads run as one
batched product.
"""

from __future__ import annotations

import heapq
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from verispec.core.argmax import argmax
from verispec.core.errors import VerispecError
from verispec.core.sampling import sample, warp_probs
from verispec.core.tree import TreeSettings
from verispec.core.types import Proposal
from verispec.drafters.base import Drafter, DraftRequest
from verispec.drafters.learned import ReducedHead, drafting_view, load_net

if TYPE_CHECKING:
    from transformers import PreTrainedModel


class MedusaNet(nn.Module):
    """h [..., hidden] -> per-head features [..., heads, hidden] (before the LM head)."""

    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(heads, hidden, hidden))  # [heads, out, in]
        self.bias = nn.Parameter(torch.zeros(heads, hidden))

    @property
    def num_heads(self) -> int:
        return int(self.weight.shape[0])

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        # hidden: [..., hidden] -> [..., heads, hidden]
        projected = torch.einsum("...i,koi->...ko", hidden, self.weight) + self.bias
        return hidden.unsqueeze(-2) + nn.functional.silu(projected)


def medusa_settings(target: PreTrainedModel, heads: int = 4) -> dict:
    config = target.config.get_text_config(decoder=True)
    return {"hidden": int(config.hidden_size), "heads": heads}


def static_tree(rank_accuracy: list[list[float]], nodes: int) -> list[tuple[int, ...]]:
    """Medusa's sparse tree: the `nodes` rank paths most likely to be accepted, best first.

    rank_accuracy[d][r]: how often head d's r-th most probable token is the right one (measured on
    calibration data). A path (r_1, ..., r_d) stands for head 1's r_1-th token, then head 2's r_2-th,
    ...; its chance is taken as the product of its accuracies. Extending a path never raises that
    product, so growing best-first keeps every chosen path's prefixes.

    Example: accuracies [[0.6, 0.2], [0.5, 0.1]], 3 nodes -> [(0,), (0, 0), (1,)] (0.6, 0.3, 0.2).
    """
    heap = [(-acc, (rank,)) for rank, acc in enumerate(rank_accuracy[0])]
    heapq.heapify(heap)
    chosen: list[tuple[int, ...]] = []
    while heap and len(chosen) < nodes:
        score, path = heapq.heappop(heap)
        chosen.append(path)
        if len(path) < len(rank_accuracy):
            for rank, acc in enumerate(rank_accuracy[len(path)]):
                heapq.heappush(heap, (score * acc, path + (rank,)))
    return chosen


class MedusaDrafter(Drafter):
    """Drafts min(k, heads) tokens from the target's last hidden state in one shot: a chain of
    each head's top token, or with `tree` settings a static tree of `tree.nodes` nodes over each
    head's top `tree.topk` tokens, shaped by the heads' measured rank accuracies."""

    needs_hidden = True
    kind = "medusa"  # the trained drafter kind `load` reads, and its network:
    net_class: type[nn.Module] = MedusaNet

    def __init__(self, target: PreTrainedModel, net: MedusaNet, head: ReducedHead,
                 tree: TreeSettings | None = None,
                 rank_accuracy: list[list[float]] | None = None) -> None:
        self.net = drafting_view(net.to(device=target.device, dtype=target.dtype).eval())
        self.head = head
        self.tree = tree
        self.choices: list[tuple[int, ...]] | None = None
        if tree is not None:
            if rank_accuracy is None:
                raise VerispecError("a Medusa tree needs the heads' measured rank accuracies "
                                    "(drafter.json rank_accuracy, written by verispec train medusa)")
            self.choices = static_tree([row[: tree.topk] for row in rank_accuracy], tree.nodes)

    @classmethod
    def load(cls, path: str | Path, target: PreTrainedModel,
             tree: TreeSettings | None = None) -> MedusaDrafter:
        net, config, weights = load_net(path, target, cls.kind, cls.net_class)
        return cls(target, net, ReducedHead.of(target, weights["vocab_ids"].long()), tree,
                   config.get("rank_accuracy"))

    def reset(self) -> None:
        pass  # stateless: everything comes from the target's hidden state

    @torch.inference_mode()
    def propose(self, request: DraftRequest) -> Proposal:
        hidden = request.target_hidden  # [context_len - 1, hidden]
        if hidden is None:
            raise VerispecError(f"{type(self).__name__} needs the target's hidden states")
        if hidden.shape[0] == 0:
            return Proposal(request.tokens[:0])
        k = min(request.k, self.net.num_heads)
        logits = self.head.logits(self._features(request, k)).float()  # [k, reduced]
        if self.choices is not None:
            return self._tree(logits)
        if request.sampling.greedy:
            return Proposal(self.head.vocab_ids[argmax(logits)])
        q = warp_probs(self.head.full(logits), request.sampling)  # [k, vocab]
        return Proposal(sample(q, request.generator), q)

    def _features(self, request: DraftRequest, k: int) -> torch.Tensor:
        """The first k heads' features [k, hidden] for the LM head, from the request (its
        target_hidden: the target's states at every committed position but the last); Medusa
        reads the newest state only."""
        return self.net(request.target_hidden[-1])[:k]

    def _tree(self, logits: torch.Tensor) -> Proposal:
        """The static tree's nodes no deeper than the heads run; logits [heads run, reduced].

        Deterministic under sampling too (q one-hot per node), which tree verification handles.
        """
        paths = sorted((p for p in self.choices if len(p) <= logits.shape[0]), key=lambda p: (len(p), p))
        ranked = logits.topk(1 + max(max(p) for p in paths), dim=-1).indices  # [heads run, ranks]
        index = {path: i for i, path in enumerate(paths)}
        heads = torch.tensor([len(p) - 1 for p in paths], device=logits.device)
        ranks = torch.tensor([p[-1] for p in paths], device=logits.device)
        parents = torch.tensor([index.get(p[:-1], -1) for p in paths], device=logits.device)
        return Proposal(self.head.vocab_ids[ranked[heads, ranks]], parents=parents)

    def commit(self, num_accepted: int) -> None:
        pass
