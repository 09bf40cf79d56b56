"""Multi-token prediction heads (Gloeckle et al. 2024) on the target's frozen trunk.

Gloeckle et al. pretrain a shared trunk with n output heads, head i a transformer layer that
predicts token t+i, all feeding one shared unembedding. verispec cannot pretrain the target, so
the target is the trunk, frozen, and its own last layer and LM head are the next-token head
(head 1): the trained heads 2..N+1 are Llama-shaped decoder layers (verispec.drafters.nn) over
the target's final hidden states h_{<=t}, each read out through the target's final norm and LM
head (restricted to a frequency-ranked vocabulary, see ReducedHead), trained head by head in the
paper's memory-saving order (verispec.training.losses.multi_head_backward).

A model pretrained with its heads (verispec's byte model, verispec.training.bytes) is the paper's
shape itself: its first L - 1 layers are the trunk, its last layer is head 1, and the heads read
the trunk's output, the residual state after layer L - 1 (`trunk_layer`), which the engine hands
over with the final states (Drafter.hidden_layers) at no extra forward.

Drafting is self-speculation with those heads: as Medusa's heads, they read only the target's
real states, so each draft is a chain of every head's top token or a static tree over their top
tokens. Unlike Medusa's, a head attends over every position before t, through a KV cache that
holds real positions only (nothing to rewind after verification). All heads read the same
states, so they draft as one layer whose batch is the heads (StackedHeads).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import nn

from verispec.core.errors import VerispecError
from verispec.core.tree import TreeSettings
from verispec.drafters.base import DraftRequest
from verispec.drafters.learned import ReducedHead
from verispec.drafters.medusa import MedusaDrafter
from verispec.drafters.nn import DecoderLayer, RMSNorm, attention, rms_norm, rotary
from verispec.model.kv_cache import KVCache
from verispec.model.packed import per_model

if TYPE_CHECKING:
    from transformers import PreTrainedModel


class MTPNet(nn.Module):
    """`heads` decoder layers, each on the trunk's output h [batch, T, hidden] (causal over T).

    trunk_layer: which of the target's states is the trunk's output: None, its final (normed)
    states (heads trained on a frozen target); L, the residual state after its first L layers
    (a model pretrained with its heads, whose layers after L are head 1).
    """

    def __init__(self, hidden: int, attention_heads: int, intermediate: int, heads: int,
                 trunk_layer: int | None = None) -> None:
        super().__init__()
        self.trunk_layer = trunk_layer
        self.layers = nn.ModuleList(DecoderLayer(hidden, attention_heads, intermediate)
                                    for _ in range(heads))
        for layer in self.layers:  # each head starts as the identity: the target's own next token
            nn.init.zeros_(layer.out.weight)
            nn.init.zeros_(layer.down.weight)

    @property
    def num_heads(self) -> int:
        return len(self.layers)

    def forward(self, hidden: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        # hidden: [batch, T, hidden]; positions: [T] -> [batch, T, heads, hidden] (before the norm)
        return torch.stack([layer(hidden, positions) for layer in self.layers], dim=-2)


class StackedHeads:
    """Every head of an MTPNet as one decoder layer whose batch is the heads (for drafting; the
    same arithmetic as DecoderLayer, each weight a batched product: one pass drafts for every
    head; docs/bytes.md has its cost against the heads one after another)."""

    def __init__(self, net: MTPNet) -> None:
        layers = net.layers

        def stacked(weight: Callable[[DecoderLayer], torch.Tensor]) -> torch.Tensor:
            return torch.stack([weight(layer).detach() for layer in layers])

        self.heads, self.head_dim = layers[0].heads, layers[0].head_dim
        self.eps = layers[0].attn_norm.eps
        self.attn_norm = stacked(lambda layer: layer.attn_norm.weight)[:, None]  # [H, 1, size]
        self.mlp_norm = stacked(lambda layer: layer.mlp_norm.weight)[:, None]
        # [H, in, out] each
        self.qkv = stacked(lambda layer: layer.qkv.weight).transpose(1, 2).contiguous()
        self.out = stacked(lambda layer: layer.out.weight).transpose(1, 2).contiguous()
        self.gate_up = stacked(lambda layer: layer.gate_up.weight).transpose(1, 2).contiguous()
        self.down = stacked(lambda layer: layer.down.weight).transpose(1, 2).contiguous()

    @torch.inference_mode()
    def __call__(self, x: torch.Tensor, positions: torch.Tensor, cache: KVCache) -> torch.Tensor:
        """x: [n, size], the trunk's states at positions [n], following the cached ones ->
        every head's output [H, n, size] (before the norm)."""
        count, (n, size) = self.qkv.shape[0], x.shape
        h = x.expand(count, n, size)
        q, k, v = (torch.bmm(rms_norm(h, self.attn_norm, self.eps), self.qkv)
                   .view(count, n, 3, self.heads, self.head_dim).permute(2, 0, 3, 1, 4))
        q, k = rotary(q, positions), rotary(k, positions)  # each [H, heads, n, head_dim]
        past = cache.length
        k, v = cache.append(k, v)
        attended = attention(q, k, v, past).transpose(1, 2).reshape(count, n, size)
        h = h + torch.bmm(attended, self.out)
        gate, up = torch.bmm(rms_norm(h, self.mlp_norm, self.eps), self.gate_up).chunk(2, dim=-1)
        return h + torch.bmm(nn.functional.silu(gate) * up, self.down)


def mtp_settings(target: PreTrainedModel, heads: int = 4) -> dict:
    """Heads as wide as the target's layers, with half its MLP width: a third fewer weights than
    one of its layers (2.7 M a head for the built-in model, so four ship in 21 MB of float16)."""
    config = target.config.get_text_config(decoder=True)
    return {"hidden": int(config.hidden_size), "attention_heads": int(config.num_attention_heads),
            "intermediate": int(config.intermediate_size) // 2, "heads": heads}


def unembedding_norm(target: PreTrainedModel) -> RMSNorm:
    """A frozen float32 copy of the target's final norm: with its LM head, the unembedding every
    MTP head shares."""
    norm = getattr(getattr(target, "model", None), "norm", None)
    if getattr(norm, "weight", None) is None:
        raise VerispecError(f"MTP heads read out through the target's final norm; "
                            f"{type(target).__name__} has none at .model.norm")
    config = target.config.get_text_config(decoder=True)
    with torch.device(norm.weight.device):  # beside the target's states, on any device
        copy = RMSNorm(norm.weight.shape[0], float(getattr(config, "rms_norm_eps", 1e-5)))
    copy.weight.data.copy_(norm.weight.detach().float())
    return copy.requires_grad_(False)


# net -> its heads stacked (StackedHeads): the drafters of one network, one per sequence in a batch
# or a server, share one copy (each made its own: 53 MB resident for the built-in model's four heads, so 500
# samples of one prompt took 24 GB and were killed for memory)
_STACKED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class MTPDrafter(MedusaDrafter):
    """Medusa's drafting (chain or static tree, see MedusaDrafter) with MTP heads' features."""

    kind = "mtp"
    net_class = MTPNet

    def __init__(self, target: PreTrainedModel, net: MTPNet, head: ReducedHead,
                 tree: TreeSettings | None = None,
                 rank_accuracy: list[list[float]] | None = None) -> None:
        super().__init__(target, net, head, tree, rank_accuracy)
        self.stacked = per_model(_STACKED, self.net, StackedHeads)
        self.norm = unembedding_norm(target).to(device=target.device, dtype=target.dtype)
        self.cache = KVCache()  # every head's keys and values, the heads as its batch
        self.hidden_layers = () if net.trunk_layer is None else (net.trunk_layer,)

    def reset(self) -> None:
        self.cache = KVCache()

    def _features(self, request: DraftRequest, k: int) -> torch.Tensor:
        """The heads over the positions of the trunk's output their cache lacks (every head runs,
        in one batched layer); the first k heads' outputs at the newest, normed: [k, hidden].
        request.target_hidden: [n, hidden * (1 + len(hidden_layers))], the final states then the
        trunk's."""
        hidden = request.target_hidden
        if self.hidden_layers:
            hidden = hidden[:, hidden.shape[1] // 2:]
        start = self.cache.length
        positions = torch.arange(start, hidden.shape[0], device=hidden.device)
        return self.norm(self.stacked(hidden[start:], positions, self.cache)[:k, -1])
