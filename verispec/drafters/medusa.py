"""Medusa-1 heads (Cai et al. 2024): K residual heads on the target's last hidden state.

Head k reads the hidden state h_i of the last position the target has scored (whose own LM head
output is the newest committed token x_{i+1}) and predicts x_{i+1+k}, as
softmax(W_head · (h_i + SiLU(W_k h_i + b_k))). W_k starts at zero; W_head is the target's own
LM head, frozen and shared by every head (restricted to a frequency-ranked vocabulary, see
ReducedHead), so each head adds only hidden² + hidden weights. The heads draft a chain (top-1
per head); all heads run as one batched product.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn
from transformers import PreTrainedModel

from verispec.drafters.base import DraftRequest
from verispec.drafters.learned import ReducedHead, load_drafter
from verispec.errors import VerispecError
from verispec.sampling import sample, warp_probs
from verispec.types import Proposal


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


class MedusaDrafter:
    """Drafts min(k, heads) tokens from the target's last hidden state in one shot."""

    needs_hidden = True

    def __init__(self, target: PreTrainedModel, net: MedusaNet, head: ReducedHead) -> None:
        self.net = net.to(device=target.device, dtype=target.dtype).eval()
        self.head = head

    @classmethod
    def load(cls, path: str | Path, target: PreTrainedModel) -> MedusaDrafter:
        config, weights = load_drafter(path, target, "medusa")
        net = MedusaNet(**config["settings"])
        net.load_state_dict({k.removeprefix("net."): v for k, v in weights.items()
                             if k.startswith("net.")})
        return cls(target, net, ReducedHead(target, weights["vocab_ids"].long()))

    def reset(self) -> None:
        pass  # stateless: everything comes from the target's hidden state

    @torch.inference_mode()
    def propose(self, request: DraftRequest) -> Proposal:
        hidden = request.target_hidden  # [context_len - 1, hidden]
        if hidden is None:
            raise VerispecError("Medusa heads need the target's hidden states")
        if hidden.shape[0] == 0:
            return Proposal(request.tokens[:0])
        k = min(request.k, self.net.num_heads)
        features = self.net(hidden[-1])[:k]  # [k, hidden]
        logits = self.head.logits(features).float()  # [k, reduced]
        if request.sampling.greedy:
            return Proposal(self.head.vocab_ids[logits.argmax(-1)])
        q = warp_probs(self.head.full(logits), request.sampling)  # [k, vocab]
        return Proposal(sample(q, request.generator), q)

    def commit(self, num_accepted: int) -> None:
        pass
