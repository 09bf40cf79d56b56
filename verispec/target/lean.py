"""Llama-family decoders run directly on CPU (gpt-fast style): fused prepacked weights and a
preallocated KV cache instead of Hugging Face's forward.

For a small model on a 2-core CPU, what surrounds the matrix products is a large share of a step:
Hugging Face's forward builds position ids, masks and cache objects per call, runs q, k, v and
gate, up as separate products, repeats keys and values for grouped-query attention, and its
DynamicCache appends by concatenation, copying every cached key and value at every step.
Measured on this project's 2-core AMD machine (SmolLM2-135M, float32, 300 cached tokens): the
linear layers alone take 43 ms for one token and 50 ms for four, the whole forward 55 and 78 ms.
This module runs the same weights with the same arithmetic (RMSNorm in float32, rotary
embeddings from the model's own rotary module, scaled dot-product attention) and none of that
glue: keys and values are written into place, q/k/v and gate/up are one product each.

It applies to decoders of the plain Llama shape (Llama, Mistral and Qwen2 without sliding
windows) whose linear layers can be prepacked (`packed.can_pack`); every other model runs
through its own forward (verispec.target.cached_model). On a GPU the products are plain fused F.linear
calls (`DenseLinear`), at a fixed row count when invariant (`FIXED_ROWS`: cuBLAS picks its kernel
by row count; docs/invariance.md, CUDA).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn
from transformers import PreTrainedModel

from verispec.target.kv_cache import KVCache
from verispec.target.lowbit import DenseKernel, QuantLinear
from verispec.target.packed import can_pack, cpu_packs, pack_weight, packed_linear, per_model

LEAN_CLASSES = frozenset({"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM"})

# Off the CPU (cuBLAS) a product's kernel and reduction split may depend on its row count (not
# yet measured on a GPU: docs/invariance.md, CUDA), so an invariant forward runs every product and
# norm there on chunks of exactly this many rows (zero-padded).
FIXED_ROWS = 32

# model -> (fingerprint of its linear weights, LeanWeights): engines built per call share them.
_WEIGHTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def lean_supported(model: PreTrainedModel) -> bool:
    """Whether `model` has the plain Llama shape this module runs, on a CPU that packs its dtype
    or on a GPU (float weights: fused F.linear at a fixed row count, docs/invariance.md)."""
    parameter = next(model.parameters(), None)
    on_gpu = (parameter is not None and parameter.device.type == "cuda"
              and parameter.dtype in (torch.float32, torch.bfloat16, torch.float16))
    if type(model).__name__ not in LEAN_CLASSES or not (can_pack(model) or on_gpu):
        return False
    config = model.config.get_text_config(decoder=True)
    if getattr(config, "hidden_act", None) != "silu":
        return False
    if type(model).__name__ == "MistralForCausalLM" and getattr(config, "sliding_window", None):
        return False  # Mistral's window is model-wide; Qwen2 sets it per layer (checked below)
    body = getattr(model, "model", None)
    needed = ("embed_tokens", "layers", "norm", "rotary_emb")
    if body is None or not all(hasattr(body, name) for name in needed):
        return False
    for layer in body.layers:
        attention = getattr(layer, "self_attn", None)
        if (attention is None or getattr(attention, "sliding_window", None) is not None
                or not all(hasattr(attention, p) for p in ("q_proj", "k_proj", "v_proj", "o_proj"))
                or hasattr(attention, "q_norm")
                or not all(hasattr(layer.mlp, p) for p in ("gate_proj", "up_proj", "down_proj"))):
            return False
    return True


@dataclass(frozen=True)
class Linear:
    """A prepacked weight and its bias (None: no bias)."""

    packed: torch.Tensor
    bias: torch.Tensor | None

    @classmethod
    def fuse(cls, layers: list[nn.Linear]) -> Product:
        """One product for several linear layers over the same input (outputs concatenated): a
        prepacked float weight, or one 4-bit kernel over the layers of a 4-bit target."""
        if isinstance(layers[0], QuantLinear):
            return QuantLinear.fused(layers)
        weight = torch.cat([layer.weight.detach() for layer in layers])
        biases = [layer.bias for layer in layers]
        bias = None
        if any(b is not None for b in biases):
            bias = torch.cat([b.detach() if b is not None else weight.new_zeros(layer.out_features)
                              for b, layer in zip(biases, layers)])
        if weight.device.type != "cpu":
            return DenseLinear(weight, bias)
        return cls(pack_weight(weight), bias)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        # x: [..., in_features] -> [..., out_features]
        return packed_linear(x, self.packed, self.bias)


@dataclass(frozen=True)
class DenseLinear:
    """A fused weight off the CPU (no oneDNN packing there) and its bias: F.linear."""

    weight: torch.Tensor
    bias: torch.Tensor | None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(x, self.weight, self.bias)


# A product over one or more linear layers' weights (fused by rows): x [..., in] -> [..., out].
Product = Callable[[torch.Tensor], torch.Tensor]


def at_fixed_rows(f: Product, h: torch.Tensor, rows: int = FIXED_ROWS) -> torch.Tensor:
    """f(h) computed on chunks of exactly `rows` rows (the last zero-padded), so that a row's
    result does not depend on how many rows came with it. h: [..., n, in] -> [..., n, out]."""
    n = h.shape[-2]
    padded = h.new_zeros(*h.shape[:-2], -(-n // rows) * rows, h.shape[-1])
    padded[..., :n, :] = h
    return torch.cat([f(chunk) for chunk in padded.split(rows, dim=-2)], dim=-2)[..., :n, :]


@dataclass(frozen=True)
class Layer:
    attn_norm: Product
    qkv: Product
    out: Product
    mlp_norm: Product
    gate_up: Product
    down: Product


class LeanWeights:
    """The fused weights of one model, shared by every decoder that runs it.

    linear: builds one product from linear layers over the same input (default: their float
    weights prepacked; verispec.drafters.self_spec stores them in low precision). layers: the
    decoder layers kept, in order (default: all; fewer skips the others, Draft & Verify style).
    norm: what runs each RMSNorm module (default: the module itself, as the model computes it; for
    a 4-bit target, whose arithmetic is verispec's own, torch's fused rms_norm, one op for seven).
    """

    def __init__(self, model: PreTrainedModel, linear: Callable[[list[nn.Linear]], Product] = Linear.fuse,
                 layers: Sequence[int] | None = None,
                 norm: Callable[[nn.Module], Product] | None = None) -> None:
        config = model.config.get_text_config(decoder=True)
        body = model.model
        four_bit = isinstance(body.layers[0].mlp.down_proj, QuantLinear)
        if norm is None:
            norm = fused_rms_norm if four_bit else (lambda module: module)
        attention = body.layers[0].self_attn
        self.heads = int(config.num_attention_heads)
        self.kv_heads = int(getattr(config, "num_key_value_heads", None) or self.heads)
        self.head_dim = int(attention.head_dim)
        self.scaling = float(attention.scaling)
        self.embed = body.embed_tokens
        self.rotary = body.rotary_emb
        self.norm = norm(body.norm)
        self.head = linear([model.get_output_embeddings()])
        kept = range(len(body.layers)) if layers is None else layers
        # Prepacked float32 products over 1536 inputs (the MLP's down projection) round a lone
        # row differently from the same row among 2..17 (scripts/invariance_probe.py; every other
        # shape of the built-in model agrees), so invariant one-row passes multiply two copies of
        # the row there. The 4-bit kernel is row-invariant from one row on: it needs nothing.
        on_cpu = model.get_output_embeddings().weight.device.type == "cpu"
        self.pair_lone_rows = (on_cpu and linear == Linear.fuse
                               and not isinstance(body.layers[0].mlp.down_proj, QuantLinear))
        # Off the CPU every product and norm of an invariant forward runs at FIXED_ROWS rows.
        self.fixed_rows = not on_cpu
        def stack(product: Callable[[list[nn.Linear]], Product]) -> list[Layer]:
            return [Layer(
                norm(layer.input_layernorm),
                product([layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj]),
                product([layer.self_attn.o_proj]),
                norm(layer.post_attention_layernorm),
                product([layer.mlp.gate_proj, layer.mlp.up_proj]),
                product([layer.mlp.down_proj])) for layer in (body.layers[i] for i in kept)]

        self.layers = stack(linear)
        # A 4-bit target's prompts go through bfloat16 copies of its layers: the int4 kernel is a
        # matrix-vector kernel, slow on many rows (a 300-token prefill: 277 ms against 151 ms in
        # bfloat16, docs/int4.md). Plain and speculative decoding both prefill that way, so the
        # guarantee holds; it costs 2 bytes a weight.
        self.prompt_layers: list[Layer] | None = None
        if linear == Linear.fuse and four_bit and cpu_packs(torch.bfloat16):
            self.prompt_layers = stack(bfloat16_copy)

    @classmethod
    def of(cls, model: PreTrainedModel) -> LeanWeights:
        """The (cached) weights of `model`; renewed when a linear weight was replaced or changed."""
        return per_model(_WEIGHTS, model, cls)


def bfloat16_copy(layers: list[nn.Linear]) -> Product:
    """One product over the layers' weights (a 4-bit target's: the values its codes stand for)
    rounded to bfloat16 and prepacked; float activations in and out."""
    return DenseKernel(torch.cat([layer.weight.detach() for layer in layers]), torch.bfloat16, True)


def fused_rms_norm(module: nn.Module) -> Product:
    """A Llama RMSNorm as one fused op (torch's rms_norm) instead of the module's seven: about
    twice as fast for one row. Rounding may differ from the module's, so only drafters use it.
    A module that is not a Llama RMSNorm (a trained early exit's adapter in the final norm's
    place) runs as it is."""
    if not hasattr(module, "variance_epsilon"):
        return module
    weight, eps = module.weight.detach(), float(module.variance_epsilon)
    return lambda x: nn.functional.rms_norm(x, weight.shape, weight, eps)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding as Llama applies it. x: [1, heads, n, head_dim]; cos, sin: [n, head_dim]."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin


@dataclass(frozen=True)
class Block:
    """New tokens for one sequence's decoder, and how they attend."""

    tokens: torch.Tensor  # [n] int64
    positions: torch.Tensor | None = None  # [n]; None: the next n positions
    mask: torch.Tensor | None = None  # [n, length + n] bool (True = attend); None: causal


def forward_rows(decoders: Sequence[LeanDecoder], blocks: Sequence[Block],
                 layers: tuple[int, ...] = ()) -> torch.Tensor:
    """Feed each decoder its block in one pass over the shared weights: the linear products run
    once over every row of every block (a batch reads the weights once), attention per sequence
    against its own cache. Returns the hidden states of all blocks' rows in order,
    [sum of n, hidden * (1 + len(layers))], as LeanDecoder.forward describes them.

    The decoders must share one LeanWeights. When they are `invariant` (the first decoder says),
    each row attends as a one-token step would (`row_attention`), so a position's logits and keys
    do not depend on the block, tree or batch it was computed in. The exception is a sequence's
    first block over an empty cache (its prompt): plain decoding and speculation both cache the
    prompt in that one causal block, so it attends as one (a third faster for a 300-token prompt).
    """
    w = decoders[0].weights
    invariant = decoders[0].invariant
    sizes = [block.tokens.shape[0] for block in blocks]
    prompts_only = all(decoder.length == 0 and block.mask is None and block.tokens.shape[0] > 1
                       for decoder, block in zip(decoders, blocks))
    stack = w.prompt_layers if prompts_only and w.prompt_layers is not None else w.layers
    attention = []  # per block: (mask, is_causal)
    positions = []
    for decoder, block, n in zip(decoders, blocks, sizes):
        past = decoder.length
        end = past + n
        positions.append(torch.arange(past, end, device=block.tokens.device)
                         if block.positions is None else block.positions)
        # A first block over an empty cache is plain causal attention, which SDPA runs without
        # materialising a mask (its flash kernel: ~35% less attention time on long prompts).
        mask = block.mask
        if mask is None and n > 1 and past > 0:
            mask = torch.ones(n, end, dtype=torch.bool, device=block.tokens.device).tril(past)
        attention.append((mask, block.mask is None and n > 1 and past == 0))
    tokens = blocks[0].tokens if len(blocks) == 1 else torch.cat([b.tokens for b in blocks])
    x = w.embed(tokens)[None]  # [1, rows, hidden]
    cos, sin = (t[0] for t in w.rotary(x, (positions[0] if len(blocks) == 1
                                           else torch.cat(positions))[None]))  # each [rows, head_dim]
    rotary = list(zip(cos.split(sizes), sin.split(sizes)))
    q_size, kv_size = w.heads * w.head_dim, w.kv_heads * w.head_dim
    widen = invariant and x.shape[1] == 1 and w.pair_lone_rows
    fixed = invariant and w.fixed_rows and not prompts_only  # prompts are cached alike anyway

    def run(f: Product, h: torch.Tensor, pair: bool = False) -> torch.Tensor:  # h: [1, rows, in]
        if fixed:
            return at_fixed_rows(f, h)
        return f(torch.cat([h, h], dim=1))[:, :1] if pair and widen else f(h)

    captured = []
    for index, layer in enumerate(stack):
        if index in layers:
            captured.append(x[0])
        attended = []
        for decoder, block, qkv, n, (cos, sin), (mask, causal) in zip(
                decoders, blocks, run(layer.qkv, run(layer.attn_norm, x)).split(sizes, dim=1), sizes, rotary,
                attention):
            q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
            q = rotate(q.view(1, n, w.heads, w.head_dim).transpose(1, 2), cos, sin)
            k = rotate(k.view(1, n, w.kv_heads, w.head_dim).transpose(1, 2), cos, sin)
            keys, values = decoder.caches[index].append(
                k, v.view(1, n, w.kv_heads, w.head_dim).transpose(1, 2))
            if invariant and n > 1 and not causal:  # a chain slices its keys; a tree gathers them
                attended.append(row_attention(q, keys, values, block.mask, w.scaling,
                                              w.kv_heads != w.heads))
                continue
            attended.append(nn.functional.scaled_dot_product_attention(
                q, keys, values, attn_mask=mask, is_causal=causal, scale=w.scaling,
                enable_gqa=w.kv_heads != w.heads).transpose(1, 2).reshape(1, n, q_size))
        x = x + run(layer.out, attended[0] if len(attended) == 1 else torch.cat(attended, dim=1))
        gate, up = run(layer.gate_up, run(layer.mlp_norm, x)).chunk(2, dim=-1)
        x = x + run(layer.down, nn.functional.silu(gate) * up, pair=True)
    normed = run(w.norm, x)[0]
    return torch.cat([normed, *captured], dim=-1) if captured else normed


def row_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None,
                  scale: float, gqa: bool) -> torch.Tensor:
    """Attention of each query row over exactly the keys it sees, in cache order, one row at a
    time: the same call, on the same keys, as the one-token step at that position makes.

    SDPA over a block (or over extra masked keys) rounds differently from SDPA over the one
    query (measured here, float32: scripts/invariance_probe.py); the linear products (prepacked,
    int4) are row-invariant already, so this makes the whole forward independent of the block.
    q: [1, heads, n, head_dim]; keys, values: [1, kv_heads, length, head_dim]; mask: [n, length]
    bool (True = attend) or None (causal: row i sees the first length - n + i + 1 keys).
    Returns [1, n, heads * head_dim].
    """
    n, length = q.shape[2], keys.shape[2]
    rows = []
    for i in range(n):
        if mask is None:
            seen_keys, seen_values = keys[:, :, : length - n + i + 1], values[:, :, : length - n + i + 1]
        else:
            seen_keys, seen_values = keys[:, :, mask[i]], values[:, :, mask[i]]
        rows.append(nn.functional.scaled_dot_product_attention(
            q[:, :, i: i + 1], seen_keys, seen_values, scale=scale, enable_gqa=gqa))
    return torch.cat(rows, dim=2).transpose(1, 2).reshape(1, n, -1)


class LeanDecoder:
    """One sequence's KV cache over shared LeanWeights; feeds blocks of tokens, rewinds, compacts."""

    def __init__(self, weights: LeanWeights, device: torch.device, invariant: bool = True) -> None:
        self.weights = weights
        self.device = device
        self.invariant = invariant  # rows attend one at a time (forward_rows): block-independent bits
        self.caches = [KVCache() for _ in self.weights.layers]

    @classmethod
    def of(cls, model: PreTrainedModel) -> LeanDecoder:
        """A decoder over `model`'s own (prepacked float) weights."""
        return cls(LeanWeights.of(model), model.device)

    @property
    def length(self) -> int:
        return self.caches[0].length

    def reset(self) -> None:
        """Empty the cache and free its buffers (a finished sequence's cache holds no memory)."""
        self.caches = [KVCache() for _ in self.weights.layers]

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor | None = None,
                mask: torch.Tensor | None = None, layers: tuple[int, ...] = ()) -> torch.Tensor:
        """Append tokens [n] to the cache; return the final normed hidden states [n, hidden],
        followed by the residual states after the first L layers for each L in `layers`
        (increasing; Hugging Face's hidden_states[L]): [n, hidden * (1 + len(layers))].

        positions: [n] (default: the next n positions); mask: [n, length + n] bool (True =
        attend), default causal.
        """
        return forward_rows([self], [Block(tokens, positions, mask)], layers)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [n, hidden] -> logits [n, vocab] through the model's LM head."""
        if self.invariant and self.weights.fixed_rows:
            return at_fixed_rows(self.weights.head, hidden)
        return self.weights.head(hidden)

    def rewind(self, length: int) -> None:
        """Keep only the first `length` cached tokens."""
        for cache in self.caches:
            cache.rewind(length)

    def keep(self, start: int, rows: list[int]) -> None:
        """Keep the first `start` cached tokens, then the block rows `rows` after them, in order."""
        index = torch.tensor(rows, device=self.device) + start
        for cache in self.caches:
            cache.keep(start, index)
