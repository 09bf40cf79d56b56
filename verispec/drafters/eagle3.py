"""EAGLE-3 drafter (Li et al. 2025) in exactly the structure vLLM and SGLang run.

The target hands over its residual states after three of its layers ("aux" layers; Hugging Face
hidden_states[L] for L in aux_layers, by default 2, N // 2 and N - 3 of N layers). At position i
they are fused by `fc` [H, 3H] into one state g_i; one decoder layer then reads, side by side,
the RMS-normed embedding of the next token x_{i+1} and the RMS-normed g_i (its q, k, v take 2H
inputs), with g_i itself as the residual (norm_before_residual false). Its output before the
final norm, o_i, is what the drafter feeds itself when it drafts on from a predicted position
(no fc there: it is already H wide); norm + its own lm_head over a reduced draft vocabulary
give the draft logits. Draft id j is target id j + d2t[j]; t2d marks the target ids drafted.

In formulas, for one position (e = embedding of x_{i+1}, g = fc(aux_i) or the previous o):

    a = attention(concat[input_layernorm(e), hidden_norm(g)])   # q, k, v: [., 2H] -> heads
    r = g + o_proj(a)
    o = r + mlp(post_attention_layernorm(r))
    draft logits = lm_head(norm(o))                              # [draft_vocab]

Module and parameter names follow the engines' checkpoints (fc, layers.0.self_attn.q_proj, ...),
so the state dict is what verispec.export writes; the target's embedding is borrowed, never
stored. Drafting (chains, trees, sampling) is EagleDrafter's: only how positions built from the
target's states enter, and how a feature becomes logits, differ.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from verispec.core.errors import VerispecError
from verispec.core.tree import TreeSettings
from verispec.drafters.eagle import EagleDrafter, NativeLayer, loop_product, loop_stack
from verispec.drafters.learned import load_net
from verispec.drafters.nn import KVCache, RMSNorm, rotary
from verispec.model.graphs import sdpa

if TYPE_CHECKING:
    from transformers import PreTrainedModel


def default_aux_layers(num_layers: int) -> tuple[int, ...]:
    """The aux layers vLLM and SGLang pick by default, (2, N // 2, N - 3), in increasing order
    (the order the engines concatenate them in); for a shallow target, what is left of them."""
    return tuple(sorted({min(max(a, 0), num_layers - 1) for a in (2, num_layers // 2, num_layers - 3)}))


def rope_theta(config) -> float:
    """The target's rotary base (transformers 5 keeps it in rope_parameters)."""
    params = getattr(config, "rope_parameters", None) or {}
    return float(params.get("rope_theta") or getattr(config, "rope_theta", None) or 10000.0)


def eagle3_settings(target: PreTrainedModel, aux_layers: tuple[int, ...] | None,
                    draft_vocab: int) -> dict:
    """An EAGLE-3 drafter for `target`: one layer shaped like the target's (heads, key/value
    heads, MLP width), reading the states after `aux_layers` (default: the engines' choice)."""
    config = target.config.get_text_config(decoder=True)
    hidden, heads = int(config.hidden_size), int(config.num_attention_heads)
    layers = int(config.num_hidden_layers)
    aux = default_aux_layers(layers) if aux_layers is None else tuple(aux_layers)
    if len(aux) != 3 or list(aux) != sorted(set(aux)) or not 0 <= aux[0] <= aux[-1] < layers:
        raise VerispecError(f"an EAGLE-3 drafter reads three increasing aux layers in "
                            f"0..{layers - 1}, got {list(aux)}")
    return {"hidden": hidden, "heads": heads,
            "kv_heads": int(getattr(config, "num_key_value_heads", None) or heads),
            "head_dim": int(getattr(config, "head_dim", None) or hidden // heads),
            "intermediate": int(config.intermediate_size),
            "eps": float(getattr(config, "rms_norm_eps", 1e-6)), "rope_theta": rope_theta(config),
            "aux_layers": list(aux), "draft_vocab": int(draft_vocab)}


class Eagle3Attention(nn.Module):
    def __init__(self, hidden: int, heads: int, kv_heads: int, head_dim: int, theta: float) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim, self.theta = heads, kv_heads, head_dim, theta
        self.q_proj = nn.Linear(2 * hidden, heads * head_dim, bias=False)
        self.k_proj = nn.Linear(2 * hidden, kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(2 * hidden, kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(heads * head_dim, hidden, bias=False)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, cache: KVCache | None,
                mask: torch.Tensor | None) -> torch.Tensor:
        # x: [batch, T, 2 * hidden]; positions: [T]; mask: [T, cached + T] bool or None (causal)
        batch, length, _ = x.shape

        def split(t: torch.Tensor, n: int) -> torch.Tensor:  # -> [batch, n, T, head_dim]
            return t.view(batch, length, n, self.head_dim).transpose(1, 2)

        q = rotary(split(self.q_proj(x), self.heads), positions, self.theta)
        k = rotary(split(self.k_proj(x), self.kv_heads), positions, self.theta)
        v = split(self.v_proj(x), self.kv_heads)
        past = 0
        if cache is not None:
            past = cache.length
            k, v = cache.append(k, v)
        if mask is None and length > 1:
            mask = torch.ones(length, past + length, dtype=torch.bool, device=x.device).tril(past)
        # grouped-query attention: each key/value head serves heads // kv_heads query heads
        out = sdpa(q, k, v, attn_mask=mask, enable_gqa=self.kv_heads != self.heads)
        return self.o_proj(out.transpose(1, 2).reshape(batch, length, -1))


class Eagle3MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


class Eagle3Layer(nn.Module):
    """Layer 0 of an EAGLE-3 drafter: embedding and feature normed apart, attended together."""

    def __init__(self, hidden: int, heads: int, kv_heads: int, head_dim: int, intermediate: int,
                 eps: float, theta: float) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(hidden, eps)
        self.hidden_norm = RMSNorm(hidden, eps)
        self.self_attn = Eagle3Attention(hidden, heads, kv_heads, head_dim, theta)
        self.post_attention_layernorm = RMSNorm(hidden, eps)
        self.mlp = Eagle3MLP(hidden, intermediate)

    def forward(self, embeds: torch.Tensor, feature: torch.Tensor, positions: torch.Tensor,
                cache: KVCache | None, mask: torch.Tensor | None) -> torch.Tensor:
        # embeds, feature: [batch, T, hidden] -> o, the output before the final norm
        x = torch.cat([self.input_layernorm(embeds), self.hidden_norm(feature)], -1)
        residual = feature + self.self_attn(x, positions, cache, mask)
        return residual + self.mlp(self.post_attention_layernorm(residual))


class Eagle3Net(nn.Module):
    """fc, layers.0, norm and lm_head of an EAGLE-3 drafter (see the module docstring)."""

    def __init__(self, hidden: int, heads: int, kv_heads: int, head_dim: int, intermediate: int,
                 eps: float, rope_theta: float, aux_layers: list[int], draft_vocab: int) -> None:
        super().__init__()
        self.aux_layers = tuple(aux_layers)
        self.fc = nn.Linear(len(aux_layers) * hidden, hidden, bias=False)
        self.layers = nn.ModuleList([Eagle3Layer(hidden, heads, kv_heads, head_dim, intermediate,
                                                 eps, rope_theta)])
        self.norm = RMSNorm(hidden, eps)
        self.lm_head = nn.Linear(hidden, draft_vocab, bias=False)

    def forward(self, embeds: torch.Tensor, feature: torch.Tensor, positions: torch.Tensor,
                cache: KVCache | None = None, mask: torch.Tensor | None = None) -> torch.Tensor:
        """embeds, feature: [batch, T, hidden] (feature: fc of the aux states, or a previous
        output); positions: [T]; mask: [T, cached + T] or None (causal). Returns o [batch, T,
        hidden], the output before the final norm: the next feature, and the logits' input."""
        return self.layers[0](embeds, feature, positions, cache, mask)

    def logits(self, output: torch.Tensor) -> torch.Tensor:
        """[..., hidden] outputs -> [..., draft_vocab] draft logits."""
        return self.lm_head(self.norm(output))

    def native(self) -> NativeLayer | None:
        """Layer 0 in rows.cpp's layer loop (eagle.loop_stack), or None: its q/k/v product reads
        the normed embedding and feature side by side (computed here, two norms and a copy),
        its residual is the feature."""
        layer = self.layers[0]
        attn, mlp = layer.self_attn, layer.mlp
        stack = loop_stack(layer.input_layernorm, layer.post_attention_layernorm,
                           [loop_product(attn.q_proj, attn.k_proj, attn.v_proj), loop_product(attn.o_proj),
                            loop_product(mlp.gate_proj, mlp.up_proj), loop_product(mlp.down_proj)],
                           attn.head_dim, attn.heads)

        def inputs(embeds: torch.Tensor, feature: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            # [1, n, hidden] each -> the residual [1, n, hidden], q/k/v's input [1, n, 2 * hidden]
            return feature, torch.cat([layer.input_layernorm(embeds), layer.hidden_norm(feature)], -1)

        return None if stack is None else NativeLayer(stack, attn.kv_heads, attn.head_dim, attn.theta, inputs)


class DraftVocabHead:
    """The drafter's own head over its draft vocabulary, in the shape EagleDrafter reads a head:
    `logits` (reduced), `full` (scattered into the target's vocabulary) and `vocab_ids`."""

    def __init__(self, net: Eagle3Net, vocab_ids: torch.Tensor, vocab_size: int) -> None:
        # vocab_ids: [draft_vocab] int64, increasing: draft id j is target id vocab_ids[j]
        self.net, self.vocab_ids, self.vocab_size = net, vocab_ids, vocab_size

    def logits(self, output: torch.Tensor) -> torch.Tensor:
        return self.net.logits(output)

    def full(self, reduced_logits: torch.Tensor) -> torch.Tensor:
        """[..., draft_vocab] -> [..., vocab] with -inf outside the draft vocabulary."""
        out = reduced_logits.new_full((*reduced_logits.shape[:-1], self.vocab_size), float("-inf"))
        return out.index_copy_(-1, self.vocab_ids, reduced_logits)


class Eagle3Drafter(EagleDrafter):
    """EagleDrafter's chains and trees, over an EAGLE-3 net: real positions enter as fc of the
    target's aux states; drafted ones feed back the layer's output before the final norm."""

    kind = "eagle3"

    def __init__(self, target: PreTrainedModel, net: Eagle3Net, vocab_ids: torch.Tensor,
                 confidence_threshold: float | None = None, tree: TreeSettings | None = None,
                 passes: bool | None = None) -> None:
        vocab_size = target.get_input_embeddings().num_embeddings
        super().__init__(target, net, None, confidence_threshold, tree, passes)
        if len(vocab_ids) != net.lm_head.out_features or int(vocab_ids.max()) >= vocab_size:
            raise VerispecError(f"draft vocabulary of {len(vocab_ids)} ids does not fit a head of "
                                f"{net.lm_head.out_features} rows and {vocab_size} target tokens")
        self.head = DraftVocabHead(self.net, vocab_ids.to(target.device), vocab_size)
        self.hidden_layers = net.aux_layers

    @classmethod
    def load(cls, path: str | Path, target: PreTrainedModel,
             confidence_threshold: float | None = None,
             tree: TreeSettings | None = None) -> Eagle3Drafter:
        net, _, weights = load_net(path, target, cls.kind, Eagle3Net)
        return cls(target, net, weights["vocab_ids"].long(), confidence_threshold, tree)

    def _run(self, ids: torch.Tensor, states: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """EAGLE-3 reads the aux layers' states only, fused by `fc` (the final state is unused)."""
        return self._net(ids, self.net.fc(states[:, self.embed.embedding_dim:]), positions)  # [new, hidden]
