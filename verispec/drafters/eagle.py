"""EAGLE-style feature drafter (Li et al. 2024): predict the target's next hidden state, read it out.

One decoder layer takes, at position i, the target's hidden state h_i fused with the embedding of
the token x_{i+1} that followed it, and predicts h_{i+1}; the target's LM head (restricted to a
frequency-ranked vocabulary, see ReducedHead) turns that into a draft of x_{i+2}. Drafting goes on
autoregressively from predicted features. After verification the drafter keeps only positions
built from the target's real hidden states: the engine hands those over at the next proposal.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
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
from verispec.drafters.graphed import GraphedNet
from verispec.drafters.learned import Int8Linear, ReducedHead, drafting_view, load_net
from verispec.drafters.nn import ROPE_THETA, DecoderLayer, KVCache, RMSNorm, rotary_tables
from verispec.model.kernels import rows

if TYPE_CHECKING:
    from transformers import PreTrainedModel


class EagleNet(nn.Module):
    """[embedding of x_{i+1} ; h_i (; m_i)] -> predicted h_{i+1}. Shapes: [batch, T, hidden].

    With `mid_layer`, the input also holds m_i, the target's residual state after its first
    mid_layer layers (RMS-normed here): EAGLE-3 fuses such lower-level states because the last
    layer's state is specialised to the very next token. A position drafted from a predicted
    feature has no such state: it gets zeros there, in training as in drafting.
    """

    def __init__(self, hidden: int, heads: int, intermediate: int,
                 mid_layer: int | None = None) -> None:
        super().__init__()
        self.mid_layer = mid_layer
        self.fuse = nn.Linear((2 if mid_layer is None else 3) * hidden, hidden)
        self.mid_norm = None if mid_layer is None else RMSNorm(hidden)
        self.layer = DecoderLayer(hidden, heads, intermediate)

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
                cache: KVCache | None = None, mask: torch.Tensor | None = None,
                mid: torch.Tensor | None = None) -> torch.Tensor:
        # embeds, hidden, mid: [batch, T, hidden] (mid None: zeros); positions: [T];
        # mask: [T, cached + T] or None
        return self.layer(self.fused(embeds, hidden, mid), positions, cache, mask)

    def fused(self, embeds: torch.Tensor, hidden: torch.Tensor, mid: torch.Tensor | None = None
              ) -> torch.Tensor:
        """The layer's input: [batch, T, hidden] from the inputs `forward` takes."""
        parts = [embeds, hidden]
        if self.mid_norm is not None:
            parts.append(torch.zeros_like(hidden) if mid is None else self.mid_norm(mid))
        return self.fuse(torch.cat(parts, dim=-1))

    def native(self) -> NativeLayer | None:
        """This net's layer in rows.cpp's layer loop (loop_stack), or None."""
        layer = self.layer
        stack = loop_stack(layer.attn_norm, layer.mlp_norm,
                           [loop_product(layer.qkv), loop_product(layer.out),
                            loop_product(layer.gate_up), loop_product(layer.down)],
                           layer.head_dim, layer.heads)
        return None if stack is None else NativeLayer(
            stack, layer.heads, layer.head_dim, ROPE_THETA,
            lambda embeds, hidden, **extra: (self.fused(embeds, hidden, **extra), None))

    def load_unfused(self, state: dict[str, torch.Tensor]) -> None:
        """Start from the weights of a net without the mid-layer input: the same function until
        training gives the new input weight (its fuse columns start at zero)."""
        fuse = state["fuse.weight"]
        widened = torch.zeros_like(self.fuse.weight)
        widened[:, : fuse.shape[1]] = fuse
        self.load_state_dict({**state, "fuse.weight": widened,
                              "mid_norm.weight": torch.ones_like(self.mid_norm.weight)})


@dataclass(frozen=True)
class NativeLayer:
    """A drafter's decoder layer as rows.cpp's layer loop: one C++ call a pass, as a
    self-drafter's layers run (~0.6 ms of Python a pass otherwise). `inputs(embeds, features,
    **extra)` turns the net's inputs [1, n, hidden] into the loop's: the residual stream, and
    what the q/k/v product reads where that is not its norm (None)."""

    stack: object
    kv_heads: int
    head_dim: int
    theta: float
    inputs: Callable[..., tuple[torch.Tensor, torch.Tensor | None]]


def loop_product(*linears: nn.Module) -> list[object] | None:
    """Linear layers (their outputs concatenated) as one product of rows.cpp's layer loop: None
    unless each is an 8-bit drafting product without bias (learned.drafting_view) that the loop
    runs (a GPU, full-precision products and the oneDNN class do not)."""
    if not all(isinstance(p, Int8Linear) and p.bias is None for p in linears):
        return None
    return rows.native_parts([p.kernel.product for p in linears])


def loop_stack(attn_norm: nn.Module, mlp_norm: nn.Module, products: list[list[object] | None],
               head_dim: int, heads: int) -> object | None:
    """One decoder layer (its norms, and its q/k/v, o, gate/up and down products from
    loop_product) as rows.cpp's layer loop; None where a product does not run there, the norms'
    eps differ, or heads are not a multiple of 16 values wide (the loop attends 16 lanes)."""
    if None in products or head_dim % 16 or attn_norm.eps != mlp_norm.eps:
        return None
    norms = [norm.weight.detach() for norm in (attn_norm, mlp_norm)]
    return rows.native_stack([rows.native_layer(*norms, *products)], attn_norm.eps, head_dim ** -0.5,
                             heads, rows.choice().name, False)


def eagle_settings(target: PreTrainedModel) -> dict:
    """Default architecture for a target: one layer as wide as the target's."""
    config = target.config.get_text_config(decoder=True)
    return {"hidden": int(config.hidden_size), "heads": int(config.num_attention_heads),
            "intermediate": int(config.intermediate_size)}


class EagleDrafter(Drafter):
    """Drafts a chain from predicted features (stopping early below `confidence_threshold`), or,
    with `tree` settings, an EAGLE-2 dynamic tree of depth k (see verispec.core.tree.grow_tree)."""

    needs_hidden = True
    kind = "eagle"  # the trained drafter kind `load` reads

    def __init__(self, target: PreTrainedModel, net: nn.Module, head: ReducedHead | None,
                 confidence_threshold: float | None = None, tree: TreeSettings | None = None,
                 passes: bool | None = None) -> None:
        """passes: run the network as fixed-shape passes (CUDA graphs on a GPU: drafters.graphed);
        default: on a GPU only (the CPU tests force them to check them everywhere)."""
        self.net = drafting_view(net.to(device=target.device, dtype=target.dtype).eval())
        self.embed = target.get_input_embeddings()
        self.head = head
        self.confidence_threshold = confidence_threshold
        self.tree = tree
        self.real = 0  # positions in the cache built from the target's own hidden states
        # The target hands over its state after these layers too (see EagleNet's mid_layer).
        self.hidden_layers = () if getattr(net, "mid_layer", None) is None else (net.mid_layer,)
        if passes is None:
            passes = target.device.type == "cuda"
        self.graphed = (GraphedNet(self.net, self.embed, target.device, target.dtype,
                                   ("mid",) if self.hidden_layers else ()) if passes else None)
        self.cache = KVCache() if self.graphed is None else self.graphed.cache
        self.native = self.net.native() if self.graphed is None else None

    @classmethod
    def load(cls, path: str | Path, target: PreTrainedModel,
             confidence_threshold: float | None = None,
             tree: TreeSettings | None = None) -> EagleDrafter:
        net, _, weights = load_net(path, target, cls.kind, EagleNet)
        head = ReducedHead.of(target, weights["vocab_ids"].long())
        return cls(target, net, head, confidence_threshold, tree)

    def reset(self) -> None:
        if self.graphed is None:
            self.cache = KVCache()  # a finished sequence's cache holds no memory
        else:
            self.cache.rewind(0)  # fixed buffers, which the captured passes read
        self.real = 0

    @torch.inference_mode()
    def propose(self, request: DraftRequest) -> Proposal:
        states = request.target_hidden  # [context_len - 1, hidden * (1 + len(hidden_layers))]
        if states is None:
            raise VerispecError("the EAGLE drafter needs the target's hidden states")
        tokens, sampling, n = request.tokens, request.sampling, states.shape[0]
        if n == 0:
            return Proposal(tokens[:0])
        device = tokens.device
        feature = self._extend(tokens, states, n)
        self.real = n
        if self.tree is not None:
            return self._propose_tree(feature, n, request.k)
        drafted, probs = [], []
        for i in range(request.k):
            logits = self.head.logits(feature).float()  # [reduced]
            if sampling.greedy:
                index = argmax(logits)
                token = self.head.vocab_ids[index]
            else:
                q = warp_probs(self.head.full(logits), sampling)  # [vocab]
                token = sample(q, request.generator)
                probs.append(q)
            drafted.append(token)
            if (self.confidence_threshold is not None
                    and float(logits.softmax(-1).max()) < self.confidence_threshold):
                break
            if i < request.k - 1:
                feature = self._net(token.view(1), feature.view(1, -1),
                                    torch.arange(n + i, n + i + 1, device=device))[-1]  # no host copy
        return Proposal(torch.stack(drafted), torch.stack(probs) if probs else None)

    def _extend(self, tokens: torch.Tensor, states: torch.Tensor, n: int) -> torch.Tensor:
        """Run the pairs (h_i, x_{i+1}) of every real position not yet cached (self.real..n-1)
        into the cache; return the last one's predicted feature [hidden].
        tokens: [context_len]; states: [n, hidden * (1 + len(hidden_layers))]."""
        width = self.embed.embedding_dim * (1 + len(self.hidden_layers))
        if states.shape[1] != width:
            raise VerispecError(f"this {type(self).__name__} reads the target's final state and its "
                                f"state after layers {list(self.hidden_layers)}: {width} values a "
                                f"position, got {states.shape[1]}")
        positions = torch.arange(self.real, n, device=tokens.device)
        return self._run(tokens[self.real + 1: n + 1], states[self.real: n], positions)[-1]

    def _run(self, ids: torch.Tensor, states: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The network over new real positions: the tokens after them [new], the target's states
        there [new, width], positions [new] -> predicted features [new, hidden]."""
        size = self.embed.embedding_dim
        extra = {"mid": states[:, size:]} if self.hidden_layers else {}
        return self._net(ids, states[:, :size], positions, **extra)

    def _net(self, ids: torch.Tensor, inputs: torch.Tensor, positions: torch.Tensor,
             mask: torch.Tensor | None = None, **extra: torch.Tensor) -> torch.Tensor:
        """The network on tokens ids [n] and input states [n, hidden] (each extra [n, hidden]) at
        positions [n], after the cache (mask [n, cached + n] bool, or causal) -> [n, hidden]."""
        if self.graphed is not None:
            return self.graphed(ids, inputs, positions, mask, **extra)
        batched = {name: value[None] for name, value in extra.items()}
        if self.native is None:
            return self.net(self.embed(ids)[None], inputs[None], positions, self.cache, mask, **batched)[0]
        native = self.native
        x, attn_input = native.inputs(self.embed(ids)[None], inputs[None], **batched)  # [1, n, hidden]
        start = self.cache.claim(ids.shape[0], 1, native.kv_heads, native.head_dim, x)
        cos, sin = rotary_tables(positions, native.head_dim, x.dtype, native.theta)
        return native.stack.run(x, [self.cache.keys], [self.cache.values], [cos], [sin], start, [mask], [],
                                attn_input)[0][0]

    def _propose_tree(self, feature: torch.Tensor, n: int, depth: int) -> Proposal:
        """A dynamic tree grown from the root's predicted feature [hidden] (position n)."""
        device = feature.device
        features = {-1: feature}  # node -> its predicted feature (the root's is -1)
        slots: dict[int, int] = {}  # node -> its entry in self.cache

        def expand(nodes: list[int], parents: list[int], tokens: torch.Tensor) -> torch.Tensor:
            # tokens: [m] in the reduced vocabulary. Each node sees the real context, its
            # expanded ancestors and itself, at position n + its depth - 1.
            past = self.cache.length
            mask = torch.zeros(len(nodes), past + len(nodes), dtype=torch.bool, device=device)
            mask[:, : self.real] = True
            positions = []
            for row, node in enumerate(nodes):
                mask[row, past + row] = True
                ancestor, level = parents[node], 0
                while ancestor != -1:
                    mask[row, slots[ancestor]] = True
                    ancestor, level = parents[ancestor], level + 1
                positions.append(n + level)
                slots[node] = past + row
            inputs = torch.stack([features[parents[node]] for node in nodes])  # [m, hidden]
            out = self._net(self.head.vocab_ids[tokens], inputs, torch.tensor(positions, device=device), mask)
            features.update(zip(nodes, out))
            return self.head.logits(out).float().log_softmax(-1)  # [m, reduced]

        root_logp = self.head.logits(feature).float().log_softmax(-1)  # [reduced]
        tokens, parents = grow_tree(root_logp, expand, depth, self.tree)
        return Proposal(self.head.vocab_ids[tokens], parents=parents)

    def commit(self, num_accepted: int) -> None:
        # Entries built from predicted features are replaced by real ones at the next proposal.
        self.cache.rewind(self.real)
