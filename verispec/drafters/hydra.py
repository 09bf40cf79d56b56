"""Hydra heads (Ankner et al. 2024): Medusa heads made sequentially dependent.

Medusa's head k guesses x_{t+1+k} from h_t alone, blind to the tokens drafted before it. Hydra's
head i also reads them: its input is [h_t ; e(x_{t+1}) ; e(x̂_{t+2}) ; ... ; e(x̂_{t+i})], the
target's last hidden state, the embedding of the newest committed token x_{t+1} (the target's own
choice at t) and those of the tokens heads 1..i-1 drafted; it predicts x_{t+i+1}. Each head is an
MLP (a projection of that input, then a residual block, as Medusa's) read out through the
target's frozen LM head, restricted to a frequency-ranked vocabulary (ReducedHead). The
projection starts by picking h_t alone, so an untrained Hydra drafts as an untrained Medusa.

Heads draft a chain one after another (each reading the token the one before chose or sampled),
or an EAGLE-2 style dynamic tree (verispec.core.tree.grow_tree) where every node's children come from
the next head reading that node's own path. Stateless between steps: nothing to rewind.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from verispec.core.argmax import argmax
from verispec.core.errors import VerispecError
from verispec.core.sampling import sample, warp_probs
from verispec.core.tree import TreeSettings, grow_tree
from verispec.core.types import Proposal
from verispec.drafters.base import Drafter, DraftRequest
from verispec.drafters.learned import ReducedHead, drafting_view, load_net
from verispec.drafters.nn import ResBlock

if TYPE_CHECKING:
    from transformers import PreTrainedModel


class HydraNet(nn.Module):
    """Head i (0-based) maps [h ; e_1 ; ... ; e_{i+1}] [..., (i + 2) * hidden] to a feature
    [..., hidden] for the LM head."""

    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.hidden = hidden
        self.inputs = nn.ModuleList(nn.Linear((i + 2) * hidden, hidden) for i in range(heads))
        with torch.no_grad():
            for linear in self.inputs:  # starts as h itself: the untrained Medusa head
                linear.weight.zero_()
                linear.weight[:, :hidden] = torch.eye(hidden)
                linear.bias.zero_()
        self.blocks = nn.ModuleList(ResBlock(hidden) for _ in range(heads))

    @property
    def num_heads(self) -> int:
        return len(self.inputs)

    def head(self, inputs: torch.Tensor) -> torch.Tensor:
        """inputs [..., (i + 2) * hidden] -> head i's features [..., hidden]; i follows from
        the width (the number of token embeddings read)."""
        i = inputs.shape[-1] // self.hidden - 2
        return self.blocks[i](self.inputs[i](inputs))


def hydra_settings(target: PreTrainedModel, heads: int = 4) -> dict:
    config = target.config.get_text_config(decoder=True)
    return {"hidden": int(config.hidden_size), "heads": heads}


class HydraDrafter(Drafter):
    """Drafts min(k, heads) tokens: a chain, head after head, or with `tree` settings a dynamic
    tree of depth min(k, heads). Trees are chosen by rank, so deterministic (q one-hot) under
    sampling too; chains under sampling draw each token from its head's warped q."""

    needs_hidden = True
    kind = "hydra"  # the trained drafter kind `load` reads

    def __init__(self, target: PreTrainedModel, net: HydraNet, head: ReducedHead,
                 tree: TreeSettings | None = None) -> None:
        self.net = drafting_view(net.to(device=target.device, dtype=target.dtype).eval())
        self.embed = target.get_input_embeddings()
        self.head = head
        self.tree = tree

    @classmethod
    def load(cls, path: str | Path, target: PreTrainedModel,
             tree: TreeSettings | None = None) -> HydraDrafter:
        net, _, weights = load_net(path, target, cls.kind, HydraNet)
        return cls(target, net, ReducedHead.of(target, weights["vocab_ids"].long()), tree)

    def reset(self) -> None:
        pass  # stateless: everything comes from the target's hidden state and the tokens

    @torch.inference_mode()
    def propose(self, request: DraftRequest) -> Proposal:
        hidden = request.target_hidden  # [context_len - 1, hidden]
        if hidden is None:
            raise VerispecError("Hydra heads need the target's hidden states")
        if hidden.shape[0] == 0:
            return Proposal(request.tokens[:0])
        k = min(request.k, self.net.num_heads)
        inputs = torch.cat([hidden[-1], self.embed(request.tokens[-1])])  # [2 * hidden]
        if self.tree is not None:
            return self._tree(inputs, k)
        drafted, probs = [], []
        for _ in range(k):
            logits = self.head.logits(self.net.head(inputs)).float()  # [reduced]
            if request.sampling.greedy:
                token = self.head.vocab_ids[argmax(logits)]
            else:
                q = warp_probs(self.head.full(logits), request.sampling)  # [vocab]
                token = sample(q, request.generator)
                probs.append(q)
            drafted.append(token)
            inputs = torch.cat([inputs, self.embed(token)])
        return Proposal(torch.stack(drafted), torch.stack(probs) if probs else None)

    def _tree(self, root_inputs: torch.Tensor, depth: int) -> Proposal:
        """A dynamic tree from the heads' input at the root, root_inputs [2 * hidden]."""
        inputs = {-1: root_inputs}  # node -> what the head after it reads: the path to it

        def expand(nodes: list[int], parents: list[int], tokens: torch.Tensor) -> torch.Tensor:
            # tokens: [m] in the reduced vocabulary; the nodes share a depth, so a head
            embedded = self.embed(self.head.vocab_ids[tokens])  # [m, hidden]
            for node, row in zip(nodes, embedded):
                inputs[node] = torch.cat([inputs[parents[node]], row])
            batch = torch.stack([inputs[node] for node in nodes])  # [m, (depth + 2) * hidden]
            return self.head.logits(self.net.head(batch)).float().log_softmax(-1)  # [m, reduced]

        root_logp = self.head.logits(self.net.head(root_inputs)).float().log_softmax(-1)
        tokens, parents = grow_tree(root_logp, expand, depth, self.tree)
        return Proposal(self.head.vocab_ids[tokens], parents=parents)

    def commit(self, num_accepted: int) -> None:
        pass
