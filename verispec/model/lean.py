"""Llama-family decoders run directly on CPU (gpt-fast style): fused prepacked weights and a
preallocated KV cache instead of Hugging Face's forward.

For a small model on a 2-core CPU, what surrounds the matrix products is a large share of a step:
Hugging Face's forward builds position ids, masks and cache objects per call, runs q, k, v and
gate, up as separate products, repeats keys and values for grouped-query attention, and its
DynamicCache appends by concatenation, copying every cached key and value at every step (what
that glue cost: docs/performance.md, "Figures behind the target's design"). This module runs the same weights
with the same arithmetic (RMSNorm in float32, rotary embeddings from the model's own rotary
module, scaled dot-product attention) and none of that glue: keys and values are written into
place, q/k/v and gate/up are one product each.

It runs the decoder families in `FAMILIES` (Llama, Mistral, Qwen2/2.5, Qwen3, Gemma 3), each
described as data (`Family`: its norms, activation, biases, attention windows, embedding scale,
rotary tables), with one forward for all of them; every other model runs through its own forward
(verispec.model.cached_model). On a GPU the products are plain fused F.linear calls
(`DenseLinear`), at a fixed row count when invariant (`FIXED_ROWS`: cuBLAS picks its kernel by row
count; docs/invariance.md, CUDA), and every step after the prompt is a fixed-shape pass over a
fixed KV buffer (`static_forward`), captured as a CUDA graph (verispec.model.graphs).
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from verispec.core.errors import VerispecError
from verispec.model.gguf_blocks import RowsBlocksKernel
from verispec.model.graphs import STATIC_KEYS, StaticPasses, graphs_enabled, pass_attention, sdpa
from verispec.model.kernels import rows
from verispec.model.kv_cache import KVCache
from verispec.model.lowbit import DenseKernel, Int4Groups, QuantLinear, RowKernel, RowsInt4Kernel
from verispec.model.packed import can_pack, cpu_packs, pack_weight, packed_linear, per_model

if TYPE_CHECKING:
    from transformers import PreTrainedModel


@dataclass(frozen=True)
class Family:
    """What sets a decoder family apart on the lean path, as data. Every family here is a stack
    of pre-norm decoder layers (attention, then a gated MLP) over rotary positions; the fields say
    what differs.

    The forward runs the model's own norm, embedding and rotary modules (their arithmetic is the
    model's); the fields say which of them exist and where they go, and `lean_supported` checks
    a model against them."""

    name: str
    classes: frozenset[str]  # the Hugging Face classes of the family
    activation: str = "silu"  # the MLP gate's (config.hidden_act / hidden_activation): ACTIVATIONS
    qkv_bias: bool = False  # q, k and v carry biases (Qwen2); Llama's config may add them too
    qk_norm: bool = False  # an RMSNorm over each head of q and of k before the rotary (Qwen3, Gemma 3)
    sandwich_norms: bool = False  # norms after attention and after the MLP too (Gemma 3)
    norm_offset: float = 0.0  # RMSNorm scales by offset + weight (Gemma: 1 + weight)
    embed_scale: bool = False  # embeddings multiplied by sqrt(hidden) (Gemma)
    # Sliding-window attention: "none"; "model" (config.sliding_window on every layer: Mistral);
    # "layers" (config.layer_types names each layer full_attention or sliding_attention).
    windows: str = "none"
    rope_per_kind: bool = False  # each attention kind its own rotary base (Gemma 3: local 10k)


FAMILIES = (
    Family("llama", frozenset({"LlamaForCausalLM"})),
    Family("mistral", frozenset({"MistralForCausalLM"}), windows="model"),
    Family("qwen2", frozenset({"Qwen2ForCausalLM"}), qkv_bias=True, windows="layers"),
    Family("qwen3", frozenset({"Qwen3ForCausalLM"}), qk_norm=True, windows="layers"),
    Family("gemma3", frozenset({"Gemma3ForCausalLM"}), activation="gelu_pytorch_tanh", qk_norm=True,
           sandwich_norms=True, norm_offset=1.0, embed_scale=True, windows="layers",
           rope_per_kind=True),
)
ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": nn.functional.silu,
    "gelu_pytorch_tanh": lambda x: nn.functional.gelu(x, approximate="tanh"),
}

# Off the CPU (cuBLAS) a product's kernel and reduction split depend on its row count (float32 on
# an H100: docs/invariance.md, CUDA), so an invariant forward runs every product and
# norm there on chunks of exactly this many rows (zero-padded).
FIXED_ROWS = 32

# model -> (fingerprint of its linear weights, LeanWeights): engines built per call share them.
_WEIGHTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def family_of(model: PreTrainedModel) -> Family | None:
    """The lean family of `model`'s class, or None."""
    return next((f for f in FAMILIES if type(model).__name__ in f.classes), None)


def lean_supported(model: PreTrainedModel) -> bool:
    """Whether `model` is of a family this module runs (and has that family's shape), on a CPU
    that packs its dtype or on a GPU (float weights: fused F.linear at a fixed row count,
    docs/invariance.md)."""
    family = family_of(model)
    parameter = next(model.parameters(), None)
    on_gpu = (parameter is not None and parameter.device.type == "cuda"
              and parameter.dtype in (torch.float32, torch.bfloat16, torch.float16))
    if family is None or not (can_pack(model) or on_gpu or rows_take_bfloat16(model)):
        return False
    config = model.config.get_text_config(decoder=True)
    if (activation_name(config) != family.activation
            or getattr(config, "final_logit_softcapping", None) is not None
            or getattr(config, "attn_logit_softcapping", None) is not None):
        return False
    body = getattr(model, "model", None)
    needed = ("embed_tokens", "layers", "norm", "rotary_emb")
    if body is None or not all(hasattr(body, name) for name in needed):
        return False
    if hasattr(body.embed_tokens, "embed_scale") != family.embed_scale:
        return False
    bias = family.qkv_bias or bool(getattr(config, "attention_bias", False))
    norms = ("input_layernorm", "post_attention_layernorm",
             *(("pre_feedforward_layernorm", "post_feedforward_layernorm") if family.sandwich_norms else ()))
    for layer in body.layers:
        attention = getattr(layer, "self_attn", None)
        if (attention is None
                or not all(hasattr(attention, p) for p in ("q_proj", "k_proj", "v_proj", "o_proj"))
                or (attention.q_proj.bias is not None) != bias
                or hasattr(attention, "q_norm") != family.qk_norm
                or not all(hasattr(layer, name) for name in norms)
                or not all(hasattr(layer.mlp, p) for p in ("gate_proj", "up_proj", "down_proj"))):
            return False
    return True


def rows_take_bfloat16(model: PreTrainedModel) -> bool:
    """Whether the row kernels run every product of a bfloat16 CPU model (each linear weight's
    shape fits them): then the lean path runs it where oneDNN cannot pack bfloat16 (an AVX2
    CPU), instead of the model's own forward, which is not row-invariant there (greedy outputs
    parted from plain decoding's on SmolLM2 held to AVX2)."""
    parameter = next(model.parameters(), None)
    if parameter is None or parameter.device.type != "cpu" or parameter.dtype != torch.bfloat16:
        return False
    linears = [module for module in model.modules() if isinstance(module, nn.Linear)]
    return rows.available() and all(rows.fits(*module.weight.shape) for module in linears)


def activation_name(config) -> str | None:
    """The MLP activation a config names (Gemma calls it hidden_activation)."""
    return getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", None)


def windows(family: Family, config) -> list[int | None]:
    """Each layer's sliding window (the keys a query sees, its own included), None: all."""
    layers = int(config.num_hidden_layers)
    window = getattr(config, "sliding_window", None)
    if family.windows == "model" and window:
        return [int(window)] * layers
    kinds = getattr(config, "layer_types", None)
    if family.windows == "layers" and window and kinds:
        return [int(window) if kind == "sliding_attention" else None for kind in kinds[:layers]]
    return [None] * layers


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
            return with_bias(QuantLinear.fused(layers), layers)
        weight = torch.cat([layer.weight.detach() for layer in layers])
        biases = [layer.bias for layer in layers]
        bias = None
        if any(b is not None for b in biases):
            bias = torch.cat([b.detach() if b is not None else weight.new_zeros(layer.out_features)
                              for b, layer in zip(biases, layers)])
        if weight.device.type != "cpu":
            return DenseLinear(weight, bias)
        if weight.dtype == torch.bfloat16 and rows.available() and rows.fits(*weight.shape):
            return with_bias(rows.DenseProduct(weight), layers)  # a bfloat16 target: the row kernel
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
    if n % rows == 0:  # whole chunks (a fixed-shape pass's): the same chunks, without the copy
        chunks = [f(chunk) for chunk in h.contiguous().split(rows, dim=-2)]
        return chunks[0] if len(chunks) == 1 else torch.cat(chunks, dim=-2)
    padded = h.new_zeros(*h.shape[:-2], -(-n // rows) * rows, h.shape[-1])
    padded[..., :n, :] = h
    return torch.cat([f(chunk) for chunk in padded.split(rows, dim=-2)], dim=-2)[..., :n, :]


@dataclass(frozen=True)
class Layer:
    """One decoder layer's products and norms, and how its attention sees the keys."""

    attn_norm: Product
    qkv: Product
    out: Product
    mlp_norm: Product
    gate_up: Product
    down: Product
    q_norm: Product | None = None  # over each head of q / k (Family.qk_norm)
    k_norm: Product | None = None
    attn_post_norm: Product | None = None  # after attention / after the MLP (Family.sandwich_norms)
    mlp_post_norm: Product | None = None
    window: int | None = None  # sliding window: a query sees the last `window` positions (its own included)
    kind: str | None = None  # the rotary table it reads (Family.rope_per_kind: its attention kind)


# The products a forward runs, by role (LeanWeights.min_rows: the fewest rows an invariant pass
# multiplies through each).
ROLES = ("qkv", "out", "gate_up", "down", "head")
# oneDNN picks its float32 kernel by the row count, and streaming a model's weights its one- and
# two-row kernels can be the slower: on a 2-core AMD EPYC (one 512-bit multiply-add a cycle) the
# built-in float32 target's products took 302 ms over ten one-row forwards and 271 over ten
# four-row ones, the same bits. So where a product's rows are the same bits at any count from 2
# (the probe below), an invariant pass of fewer rows pads them to WIDE_ROWS where this machine
# streams the model's products faster so (`wide_pays`, timed at load: the choice moves no bit).
WIDE_ROWS = 4
WIDE_MARGIN = 0.97  # wide only where it takes at most this share of the narrow sweep's time
WIDE_FLOOR = 0.002  # seconds: a model whose products sweep faster than this (a tiny one) stays narrow


class LeanWeights:
    """The fused weights of one model, shared by every decoder that runs it.

    linear: builds one product from linear layers over the same input (default: their float
    weights prepacked; verispec.drafters.self_spec stores them in low precision). layers: the
    decoder layers kept, in order (default: all; fewer skips the others, Draft & Verify style).
    norm: what runs each RMSNorm module, given the family's weight offset (default: the module's
    own ops, as the model computes it, in one C++ call where it can (`module_norm`); for a 4-bit or
    GGUF target, whose arithmetic is verispec's own, a fused rms_norm, one op for seven).
    """

    def __init__(self, model: PreTrainedModel, linear: Callable[[list[nn.Linear]], Product] = Linear.fuse,
                 layers: Sequence[int] | None = None,
                 norm: Callable[[nn.Module, float], Product] | None = None) -> None:
        config = model.config.get_text_config(decoder=True)
        family = family_of(model)
        if family is None:
            raise VerispecError(f"{type(model).__name__} is of no lean family (lean_supported)")
        self.family = family
        body = model.model
        down = body.layers[0].mlp.down_proj
        quantized = isinstance(down, QuantLinear)  # a 4-bit or GGUF target: verispec's own arithmetic
        four_bit = quantized and isinstance(down.stored, Int4Groups)
        if norm is None:
            norm = fused_rms_norm if quantized else module_norm
        attention = body.layers[0].self_attn
        self.heads = int(config.num_attention_heads)
        self.kv_heads = int(getattr(config, "num_key_value_heads", None) or self.heads)
        self.head_dim = int(attention.head_dim)
        self.scaling = float(attention.scaling)
        self.activation = ACTIVATIONS[family.activation]
        self.embed = body.embed_tokens
        self.rotary = body.rotary_emb
        half = self.head_dim // 2
        swap = torch.cat([torch.arange(half, self.head_dim), torch.arange(half)]).to(
            model.device)  # [head_dim]: rotate's halves exchanged
        # `rotate` as one C++ call where the row kernels run (the same bits; a fifth of the time)
        self.rotate: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor] = (
            rows.rotate if model.device.type == "cpu" and rows.available()
            else lambda x, cos, sin: rotate(x, cos, sin, swap))
        self.norm = norm(body.norm, family.norm_offset)
        self.head = linear([model.get_output_embeddings()])
        kept = range(len(body.layers)) if layers is None else layers
        layer_windows = windows(family, config)
        kinds = list(getattr(config, "layer_types", None) or [None] * len(body.layers))
        on_cpu = self.embed.weight.device.type == "cpu"  # (a 4-bit head's .weight would dequantize it)
        # Off the CPU every product and norm of an invariant forward runs at FIXED_ROWS rows, and
        # every step after a prompt as a fixed-shape pass over a fixed KV buffer of this many keys.
        self.fixed_rows = not on_cpu
        self.static_keys = min(int(getattr(config, "max_position_embeddings", None) or STATIC_KEYS),
                               STATIC_KEYS)
        # Rows attend through the row kernel's attention where it runs (kernels/rows.py): one
        # call for a block's rows, the same arithmetic for a row whatever came with it.
        self.row_kernel_attention = (on_cpu and rows.available() and self.head_dim in rows.HEAD_DIMS
                                     and self.embed.weight.dtype in (torch.float32, torch.bfloat16))
        # The row kernels' class at load: the target's arithmetic for its life (rows.choice()).
        self.row_kernel = rows.choice().name if self.row_kernel_attention else None

        def stack(product: Callable[[list[nn.Linear]], Product]) -> list[Layer]:
            def one(i: int) -> Layer:
                layer = body.layers[i]
                attention, mlp = layer.self_attn, layer.mlp
                sandwich = family.sandwich_norms
                return Layer(
                    norm(layer.input_layernorm, family.norm_offset),
                    product([attention.q_proj, attention.k_proj, attention.v_proj]),
                    product([attention.o_proj]),
                    norm(layer.pre_feedforward_layernorm if sandwich else layer.post_attention_layernorm,
                         family.norm_offset),
                    product([mlp.gate_proj, mlp.up_proj]),
                    product([mlp.down_proj]),
                    norm(attention.q_norm, family.norm_offset) if family.qk_norm else None,
                    norm(attention.k_norm, family.norm_offset) if family.qk_norm else None,
                    norm(layer.post_attention_layernorm, family.norm_offset) if sandwich else None,
                    norm(layer.post_feedforward_layernorm, family.norm_offset) if sandwich else None,
                    layer_windows[i], kinds[i] if family.rope_per_kind else None)
            return [one(i) for i in kept]

        self.layers = stack(linear)
        # A product may round a lone row differently from the same row among 2..17 (prepacked
        # float32 over SmolLM2's 1536 inputs, the MLP's down projection: scripts/invariance_probe.py),
        # so invariant one-row passes multiply at least two rows through those products. Which
        # ones is probed here, per role, on this model's shapes (drafters need no invariance).
        self.paired: frozenset[str] = frozenset()
        # The fewest rows an invariant pass multiplies through each product (fewer are padded
        # with zero rows): the narrow ones, or WIDE_ROWS where that streams faster.
        self.min_rows = self.narrow_rows
        if on_cpu and linear == Linear.fuse:
            first = self.layers[0]
            products = {"qkv": first.qkv, "out": first.out, "gate_up": first.gate_up,
                        "down": first.down, "head": self.head}
            widths = {"qkv": int(config.hidden_size), "out": attention.o_proj.in_features,
                      "gate_up": int(config.hidden_size), "down": body.layers[0].mlp.down_proj.in_features,
                      "head": int(config.hidden_size)}
            dtype = self.embed.weight.dtype
            # the head reads the most bytes (Gemma 3's: 671 MB in float32): fewer rows
            self.paired = frozenset(role for role in ROLES if lone_row_differs(
                products[role], widths[role], dtype, 16 if role == "head" else 64))
            self.min_rows = dict.fromkeys(ROLES, WIDE_ROWS) if wide_pays(self, widths) else self.narrow_rows
        # A 4-bit target's prompts go through bfloat16 copies of its layers: torch's int4 kernel is
        # a matrix-vector kernel, slow on many rows. Plain and speculative decoding both prefill
        # that way, so the guarantee holds; it costs 2 bytes a weight. The row kernel
        # (lowbit.RowsInt4Kernel) takes a prompt's rows about as fast as those copies, so it needs
        # none (figures: docs/performance.md, "Figures behind the target's design").
        self.prompt_layers: list[Layer] | None = None
        if (linear == Linear.fuse and four_bit and cpu_packs(torch.bfloat16)
                and not isinstance(down.kernel, RowsInt4Kernel)):
            self.prompt_layers = stack(bfloat16_copy)
        # The layer loop in one C++ call where the layers allow it (4-bit, GGUF, bfloat16 targets;
        # float32 ones of the Llama kind).
        self.native = native_layers(self)

    @property
    def pads(self) -> bool:
        """Whether an invariant pass pads some layer product's rows (min_rows), as the C++ layer
        loop always does: a decoder that is not invariant, multiplying its rows as they come,
        keeps the Python loop then."""
        return max(self.min_rows[role] for role in LAYER_ROLES) > 1

    @property
    def narrow_rows(self) -> dict[str, int]:
        """The fewest rows an invariant pass can multiply through each product: two where a lone
        row differs (`paired`), else one."""
        return {role: 2 if role in self.paired else 1 for role in ROLES}

    @classmethod
    def of(cls, model: PreTrainedModel) -> LeanWeights:
        """The (cached) weights of `model`; renewed when a linear weight was replaced or changed."""
        return per_model(_WEIGHTS, model, cls)

    def rotary_tables(self, x: torch.Tensor, positions: torch.Tensor, kind: str | None
                      ) -> tuple[torch.Tensor, torch.Tensor]:
        """What `rotate` takes at positions [rows] (of one attention kind where the family has one
        per kind): cos and the sign-folded sin, [rows, 1, head_dim], from the model's own rotary
        module."""
        tables = self.rotary(x, positions[None]) if kind is None else self.rotary(x, positions[None], kind)
        cos, sin = tables[0][0], tables[1][0]  # [rows, head_dim]
        half = sin.shape[-1] // 2
        return cos[:, None], torch.cat([-sin[:, :half], sin[:, half:]], dim=-1)[:, None]


@torch.inference_mode()
def wide_pays(w: LeanWeights, widths: dict[str, int], rounds: int = 3) -> bool:
    """Whether this machine multiplies the model's products (every layer's, then the head) over
    WIDE_ROWS rows faster than over the fewest an invariant one-row pass needs, by WIDE_MARGIN:
    timed streaming through all the weights, as a forward does (one product timed alone runs from
    the cache and hides it); the rounds alternate, the fastest of each kept. About 0.2 s for the
    built-in float32 target on 2 cores. Every product must be row-invariant from two rows."""
    sweep = [(product, role) for layer in w.layers
             for product, role in zip((layer.qkv, layer.out, layer.gate_up, layer.down), ROLES)]
    sweep.append((w.head, "head"))
    if not all(isinstance(product, Linear) for product, _ in sweep):
        return False
    x = {role: torch.randn(1, WIDE_ROWS, width, generator=torch.Generator().manual_seed(0)).to(
        w.embed.weight.dtype) for role, width in widths.items()}

    def seconds(rows: dict[str, int]) -> float:
        started = time.perf_counter()
        for product, role in sweep:
            product(x[role][:, :rows[role]])
        return time.perf_counter() - started

    wide = dict.fromkeys(ROLES, WIDE_ROWS)
    times = [(seconds(w.narrow_rows), seconds(wide)) for _ in range(1 + rounds)][1:]  # the first warms up
    fastest_narrow, fastest_wide = min(t[0] for t in times), min(t[1] for t in times)
    return fastest_narrow >= WIDE_FLOOR and fastest_wide <= WIDE_MARGIN * fastest_narrow


def pad_rows(h: torch.Tensor, rows: int) -> torch.Tensor:
    """h [..., n, features] with zero rows after its own up to `rows` rows."""
    return torch.cat([h, h.new_zeros(*h.shape[:-2], rows - h.shape[-2], h.shape[-1])], dim=-2)


@torch.inference_mode()
def lone_row_differs(product: Product, width: int, dtype: torch.dtype, rows: int = 64) -> bool:
    """Whether `product` gives any of `rows` random rows of `width` inputs (a fixed seed)
    different bits alone than among 2 or `rows` rows. A difference in the float32 sum shows in a
    bfloat16 output only where it crosses a rounding boundary, so many rows are tried."""
    x = torch.randn(rows, width, generator=torch.Generator().manual_seed(0)).to(dtype)
    alone = torch.cat([product(x[i: i + 1]) for i in range(rows)])
    pairs = torch.cat([product(x[i: i + 2])[:1] for i in range(rows - 1)])
    return not (torch.equal(product(x), alone) and torch.equal(pairs, alone[:-1]))


def bfloat16_copy(layers: list[nn.Linear]) -> Product:
    """One product over the layers' weights (a 4-bit target's: the values its codes stand for)
    rounded to bfloat16 and prepacked; float activations in and out (their biases added)."""
    kernel = DenseKernel(torch.cat([layer.weight.detach() for layer in layers]), torch.bfloat16, True)
    return with_bias(kernel, layers)


def with_bias(product: Product, layers: Sequence[nn.Module]) -> Product:
    """`product` (over the layers' weights, fused) plus the layers' biases, if any have one."""
    biases = [layer.bias for layer in layers]
    if all(b is None for b in biases):
        return product
    bias = torch.cat([b.detach().float() if b is not None else torch.zeros(layer.out_features)
                      for b, layer in zip(biases, layers)])

    def biased(x: torch.Tensor) -> torch.Tensor:
        out = product(x)
        return out + bias.to(out.dtype)
    return biased


class FusedNorm:
    """An RMSNorm as one op instead of the module's seven: the row kernels' (one C++ call, about
    a fifth of torch's on a one-token step) on a CPU where they run (`own`), else torch's rms_norm
    (about twice as fast as the module for one row). It scales by offset + weight (Gemma: 1 +
    weight). Rounding may differ from the module's, so only drafters and the 4-bit and GGUF
    targets (verispec's own arithmetic) use it; which op is fixed when the norm is made, so a
    model's arithmetic does not change in its life."""

    def __init__(self, module: nn.Module, offset: float = 0.0) -> None:
        weight = module.weight.detach() + offset
        self.shape = weight.shape
        self.eps = float(getattr(module, "variance_epsilon", getattr(module, "eps", 1e-6)))
        self.own = weight.device.type == "cpu" and rows.available()
        self.cast = {weight.dtype: weight.contiguous()}  # the weight in each activation dtype met, cast once

    def weight(self, dtype: torch.dtype) -> torch.Tensor:
        """The scale [hidden] in `dtype`."""
        scale = self.cast.get(dtype)
        if scale is None:
            scale = self.cast[dtype] = self.cast[next(iter(self.cast))].to(dtype).contiguous()
        return scale

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        scale = self.weight(x.dtype)
        if self.own and x.dtype in (torch.float32, torch.bfloat16):
            return rows.rms_norm(x, scale, self.eps)
        return nn.functional.rms_norm(x, self.shape, scale, self.eps)


def fused_rms_norm(module: nn.Module, offset: float = 0.0) -> Product:
    """A FusedNorm of `module`; a module that is no RMSNorm (a trained early exit's adapter in the
    final norm's place) runs as it is."""
    return FusedNorm(module, offset) if hasattr(module, "weight") else module


# The RMSNorm modules whose forward rows.cpp spells in their own ATen ops (module_norm), by class
# name -> whether it is Gemma 3's kind (the normalised value times 1 + weight, then in x's dtype)
# rather than Llama's (the normalised value in x's dtype, times weight). tests/test_row_kernels.py
# holds each to its module's bits.
MODULE_NORMS = {"LlamaRMSNorm": False, "MistralRMSNorm": False, "Qwen2RMSNorm": False,
                "Qwen3RMSNorm": False, "Gemma3RMSNorm": True}


class ModuleNorm:
    """An RMSNorm module of a float target (whose arithmetic is the model's own) in one C++ call
    of the module's own ops: the same bits at a fifth to a half of the module's cost through
    Python (16-31 us a call on a one-token step here; 61 a forward of SmolLM2, 109 of Gemma 3)."""

    def __init__(self, module: nn.Module) -> None:
        self.gemma = MODULE_NORMS[type(module).__name__]
        self.eps = float(getattr(module, "variance_epsilon", getattr(module, "eps", None)))
        weight = module.weight.detach()
        self.weight = 1.0 + weight.float() if self.gemma else weight  # [hidden]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return rows.module_norm(x, self.weight, self.eps, self.gemma)


def module_norm(module: nn.Module, offset: float = 0.0) -> Product:
    """`module` as the model computes it: a ModuleNorm where the row kernels run and its class is
    one rows.cpp spells (its own `offset`, Gemma's 1, is in its ops), else the module itself."""
    if (type(module).__name__ in MODULE_NORMS and module.weight.device.type == "cpu"
            and rows.available()):
        return ModuleNorm(module)
    return module


def native_norm(norm: Product | None, dtype: torch.dtype) -> tuple[str, float, torch.Tensor] | None:
    """(a norm's kind as the layer loop runs it: "rms" (rms_norm), "module" or "gemma" (a Hugging
    Face RMSNorm module's ops, Llama's or Gemma 3's), its eps, its scale) for a norm in activations
    of `dtype`, or None where the loop does not run it."""
    if isinstance(norm, FusedNorm) and norm.own:
        return "rms", norm.eps, norm.weight(dtype)
    if isinstance(norm, ModuleNorm) and norm.weight.dtype == (torch.float32 if norm.gemma else dtype):
        return "gemma" if norm.gemma else "module", norm.eps, norm.weight
    return None


def native_product(f: Product) -> list[object] | None:
    """A product as rows.cpp's layer loop takes it (rows.native_parts, rows.native_onednn), or
    None where the loop does not run it."""
    if isinstance(f, Linear):
        return rows.native_onednn(f.packed, f.bias)
    if isinstance(f, RowKernel):
        return rows.native_parts([f.product])
    if isinstance(f, rows.DenseProduct):
        return rows.native_parts([f])
    if isinstance(f, RowsBlocksKernel):
        return rows.native_parts(f.products)
    return None


# The roles of a layer's products, in the order rows.cpp's Stack takes their fewest rows.
LAYER_ROLES = ("qkv", "out", "gate_up", "down")


@dataclass(frozen=True)
class NativeLayers:
    """rows.cpp's layer loop (Stack) over a LeanWeights' layers, and what its `run` takes by
    position: the rotary kinds its layers read (each a pair of tables) and the windows they see
    through (each a mask), in the order of the layers' `kind` and `sight` indices."""

    stack: object
    kinds: tuple[str | None, ...]
    windows: tuple[int | None, ...]

    def run(self, x: torch.Tensor, caches: Sequence[KVCache], start: int,
            rotary: dict[str | None, list[tuple[torch.Tensor, torch.Tensor]]],
            sights: dict[int | None, list[Sight]], layers: tuple[int, ...]) -> tuple[torch.Tensor, list]:
        """One block's rows x [1, n, hidden] through every layer (forward_rows' `rotary` and
        `sights` of its one block); returns (x after them, x before each of `layers`)."""
        tables = [rotary[kind][0] for kind in self.kinds]
        return self.stack.run(x, [cache.keys for cache in caches], [cache.values for cache in caches],
                              [cos for cos, _ in tables], [sin for _, sin in tables], start,
                              [sights[window][0].rows for window in self.windows], list(layers), None)


def native_layers(w: LeanWeights) -> NativeLayers | None:
    """The layer loop as one C++ call (rows.cpp's Stack) over `w`'s layers, where every layer is
    of the kind it runs: products by the row kernels or oneDNN (its biases its own), a SiLU- or
    tanh-GELU-gated MLP, float32 or bfloat16 activations, norms of one kind and eps (the 4-bit,
    GGUF, bfloat16 and float32 targets of every family, windows, per-head q/k norms and sandwich
    norms included; self-drafters of float32 and bfloat16 targets). None elsewhere (Qwen2's q/k/v
    biases, but in float32, where oneDNN adds them): the Python loop of forward_rows runs."""
    dtype = w.embed.weight.dtype
    gelu = w.family.activation == "gelu_pytorch_tanh"
    if (w.row_kernel is None or w.family.activation not in ("silu", "gelu_pytorch_tanh")
            or dtype not in (torch.float32, torch.bfloat16)):
        return None
    kinds = tuple(dict.fromkeys(layer.kind for layer in w.layers))
    windows_seen = tuple(dict.fromkeys(layer.window for layer in w.layers))
    layers, norms = [], set()
    for layer in w.layers:
        named = (layer.attn_norm, layer.mlp_norm, layer.q_norm, layer.k_norm, layer.attn_post_norm,
                 layer.mlp_post_norm)  # the last four only where the family has them
        found = [None if norm is None else native_norm(norm, dtype) for norm in named]
        products = [native_product(f) for f in (layer.qkv, layer.out, layer.gate_up, layer.down)]
        if any(norm is not None and got is None for norm, got in zip(named, found)) or None in products:
            return None
        norms.update((kind, eps) for kind, eps, _ in filter(None, found))
        scales = [None if got is None else got[2] for got in found]
        layers.append(rows.native_layer(*scales[:2], *products, *scales[2:], window=layer.window,
                                        kind=kinds.index(layer.kind), sight=windows_seen.index(layer.window)))
    if len(norms) != 1:  # one kind and one eps for every norm
        return None
    (kind, eps), = norms
    stack = rows.native_stack(layers, eps, w.scaling, w.heads, w.row_kernel, kind != "rms",
                              [w.min_rows[role] for role in LAYER_ROLES], gemma_norms=kind == "gemma",
                              gelu=gelu)
    return NativeLayers(stack, kinds, windows_seen)


def rotate(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor, swap: torch.Tensor) -> torch.Tensor:
    """Rotary embedding as Llama applies it, x * cos + rotate_half(x) * sin, in four ops:
    rotate_half(x) * sin is x with its halves swapped times sin with its first half negated, the
    same products bit for bit (negation is exact). x: [1, n, heads, head_dim]; cos, signed_sin:
    [n, 1, head_dim] (LeanWeights.rotary_tables); swap: [head_dim], the halves' indices exchanged."""
    return x * cos + x.index_select(-1, swap) * signed_sin


@dataclass(frozen=True)
class Block:
    """New tokens for one sequence's decoder, and how they attend."""

    tokens: torch.Tensor  # [n] int64
    positions: torch.Tensor | None = None  # [n]; None: the next n positions
    mask: torch.Tensor | None = None  # [n, length + n] bool (True = attend); None: causal


@dataclass(frozen=True)
class Sight:
    """Which cached keys one block's rows see in a layer of a given window (None: all)."""

    mask: torch.Tensor | None  # [n, length] bool for SDPA; None: causal (is_causal) or one row
    causal: bool  # SDPA's is_causal: a whole block, no window cutting into it
    whole: bool  # a first block over an empty cache (a prompt), attended as one block
    rows: torch.Tensor | None  # [n, length] bool per row for row_attention; None: a chain


def sight(past: int, block: Block, positions: torch.Tensor, window: int | None) -> Sight:
    """What the rows of `block` (after `past` cached tokens, at `positions` [n]) see in a layer
    whose window is `window`: the block's mask (causal by default), less keys `window` or more
    positions back (Hugging Face's sliding window: key > query - window).

    A first block over an empty cache that no window cuts into is plain causal attention, which
    SDPA runs without materialising a mask (its flash kernel: docs/performance.md)."""
    n = block.tokens.shape[0]
    end, device = past + n, block.tokens.device
    whole = block.mask is None and n > 1 and past == 0
    mask = block.mask
    if mask is None and n > 1 and (past > 0 or window is not None and n > window):
        mask = torch.ones(n, end, dtype=torch.bool, device=device).tril(past)
    if window is not None and mask is not None:
        key_positions = torch.cat([torch.arange(past, device=device), positions])
        mask = mask & (key_positions[None] > positions[:, None] - window)
    return Sight(mask, whole and mask is None, whole, None if block.mask is None else mask)


def split_heads(w: LeanWeights, layer: Layer, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                run: Callable[[Product | None, torch.Tensor], torch.Tensor]
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One block's q, k, v [1, heads, n, head_dim] from its qkv product [1, n, q + 2 * kv], q and
    k rotated (together, in one rotate, where no per-head norm comes first). `run` applies a
    per-head norm as the forward applies its products (over n * heads rows, so that a fixed-row
    forward chunks rows, not heads)."""
    n, q_size, kv_size = qkv.shape[1], w.heads * w.head_dim, w.kv_heads * w.head_dim

    def heads(t: torch.Tensor, count: int, norm: Product | None) -> torch.Tensor:
        # [1, n, count * head_dim] -> [1, n, count, head_dim]
        if norm is None:
            return t.view(1, n, count, w.head_dim)
        return run(norm, t.reshape(1, n * count, w.head_dim)).view(1, n, count, w.head_dim)

    if layer.q_norm is None and layer.k_norm is None:
        qk = w.rotate(heads(qkv[..., : q_size + kv_size], w.heads + w.kv_heads, None), cos, sin)
        q, k = qk[:, :, : w.heads], qk[:, :, w.heads:]
    else:
        q = w.rotate(heads(qkv[..., :q_size], w.heads, layer.q_norm), cos, sin)
        k = w.rotate(heads(qkv[..., q_size: q_size + kv_size], w.kv_heads, layer.k_norm), cos, sin)
    v = heads(qkv[..., q_size + kv_size:], w.kv_heads, None)
    return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)


@torch.inference_mode()
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
    prompt in that one causal block, so it attends as one (SDPA's causal kernel: docs/performance.md).
    """
    w = decoders[0].weights
    invariant = decoders[0].invariant
    sizes = [block.tokens.shape[0] for block in blocks]
    prompts = [decoder.length == 0 and block.mask is None and block.tokens.shape[0] > 1
               for decoder, block in zip(decoders, blocks)]
    prompts_only = all(prompts)
    if decoders[0].passes is not None and not prompts_only:  # a GPU: fixed-shape passes
        return torch.cat([forward_rows([decoder], [block], layers) if prompt
                          else static_rows(decoder, block, layers)
                          for decoder, block, prompt in zip(decoders, blocks, prompts)])
    stack = w.prompt_layers if prompts_only and w.prompt_layers is not None else w.layers
    positions = [torch.arange(decoder.length, decoder.length + n, device=block.tokens.device)
                 if block.positions is None else block.positions
                 for decoder, block, n in zip(decoders, blocks, sizes)]
    sights = {window: [sight(decoder.length, block, where, window)
                       for decoder, block, where in zip(decoders, blocks, positions)]
              for window in {layer.window for layer in stack}}
    tokens = blocks[0].tokens if len(blocks) == 1 else torch.cat([b.tokens for b in blocks])
    x = w.embed(tokens)[None]  # [1, rows, hidden]
    every = positions[0] if len(blocks) == 1 else torch.cat(positions)
    rotary = {}  # kind -> per block (cos, signed sin), each [n, 1, head_dim]
    for kind in {layer.kind for layer in stack}:
        cos, sin = w.rotary_tables(x, every, kind)
        rotary[kind] = [(cos, sin)] if len(blocks) == 1 else list(zip(cos.split(sizes), sin.split(sizes)))
    q_size = w.heads * w.head_dim
    fixed = invariant and w.fixed_rows and not prompts_only  # prompts are cached alike anyway

    def run(f: Product | None, h: torch.Tensor, role: str = "") -> torch.Tensor:  # h: [1, rows, in]
        if f is None:
            return h
        if fixed:
            return at_fixed_rows(f, h)
        n = h.shape[1]
        if invariant and role and n < w.min_rows[role]:
            return f(pad_rows(h, w.min_rows[role]))[:, :n]
        return f(h)

    one = sights[stack[0].window][0]  # one block: what its rows see
    # The loop below in one C++ call: the same bits where rows are invariant; a drafter's rows
    # (not invariant) attend through the row kernel there, as an invariant decoder's do.
    if (w.native is not None and stack is w.layers and len(blocks) == 1 and not fixed and not one.whole
            and (invariant or not w.pads)):
        caches = decoders[0].caches
        start = [cache.claim(sizes[0], 1, w.kv_heads, w.head_dim, x) for cache in caches][0]
        x, captured = w.native.run(x, caches, start, rotary, sights, layers)
    else:
        captured = []
        for index, layer in enumerate(stack):
            if index in layers:
                captured.append(x[0])
            attended = []
            qkv_all = run(layer.qkv, run(layer.attn_norm, x), "qkv")
            for decoder, qkv, n, (cos, sin), seen in zip(
                    decoders, [qkv_all] if len(blocks) == 1 else qkv_all.split(sizes, dim=1),
                    sizes, rotary[layer.kind], sights[layer.window]):
                cache = decoder.caches[index]
                if invariant and not seen.whole and w.row_kernel_attention:
                    if layer.q_norm is None and layer.k_norm is None and not fixed:  # one C++ call
                        start = cache.claim(n, 1, w.kv_heads, w.head_dim, qkv)
                        q = rows.heads_into_cache(qkv, cos, sin, cache.keys, cache.values, start, w.heads)
                    else:
                        q, k, v = split_heads(w, layer, qkv, cos, sin, run)
                        cache.write(k, v)
                    attended.append(rows.attention(q, cache.keys, cache.values, cache.length, seen.rows,
                                                   w.scaling, w.row_kernel,
                                                   window=None if seen.rows is not None else layer.window))
                    continue
                q, k, v = split_heads(w, layer, qkv, cos, sin, run)
                cache.write(k, v)
                keys, values = cache.filled()
                if n == 1 and seen.mask is None and layer.window is not None:  # one row: the last keys
                    keys, values = keys[:, :, -layer.window:], values[:, :, -layer.window:]
                if invariant and n > 1 and not seen.whole:  # a chain slices its keys; a tree gathers them
                    attended.append(row_attention(q, keys, values, seen.rows, w.scaling,
                                                  w.kv_heads != w.heads, layer.window))
                    continue
                attended.append(sdpa(
                    q, keys, values, attn_mask=seen.mask, is_causal=seen.causal, scale=w.scaling,
                    enable_gqa=w.kv_heads != w.heads).transpose(1, 2).reshape(1, n, q_size))
            x = x + run(layer.attn_post_norm, run(layer.out, attended[0] if len(attended) == 1
                                                      else torch.cat(attended, dim=1), "out"))
            gate, up = run(layer.gate_up, run(layer.mlp_norm, x), "gate_up").chunk(2, dim=-1)
            x = x + run(layer.mlp_post_norm, run(layer.down, w.activation(gate) * up, "down"))
    normed = run(w.norm, x)[0]
    return torch.cat([normed, *captured], dim=-1) if captured else normed


@torch.inference_mode()
def static_rows(decoder: LeanDecoder, block: Block, layers: tuple[int, ...] = ()) -> torch.Tensor:
    """Feed `block` to a decoder with fixed buffers (a GPU's) as fixed-shape passes of FIXED_ROWS
    rows each (`static_forward`, replayed from a CUDA graph where graphs are on); returns its rows'
    hidden states as LeanDecoder.forward does. A block of more rows runs as several passes, each
    row seeing what the block's mask says (a tree's nodes come after their ancestors)."""
    passes = decoder.passes
    n, past = block.tokens.shape[0], decoder.length
    device = block.tokens.device
    if block.mask is not None and not torch.equal(
            block.mask[:, past:], torch.ones(n, n, dtype=torch.bool, device=device).tril()):
        return tree_rows(decoder, block, layers)
    positions = (torch.arange(past, past + n, device=device) if block.positions is None
                 else block.positions)
    visible = (torch.ones(n, past + n, dtype=torch.bool, device=device).tril(past)
               if block.mask is None else block.mask)  # [n, past + n]
    out = []
    for first in range(0, n, passes.rows):
        end = min(n, first + passes.rows)
        passes.load(past, block.tokens[first:end], positions[first:end], visible[first:end], first,
                    positions)
        hidden = passes.run(layers, lambda: static_forward(decoder.weights, decoder.caches, passes, layers))
        out.append(hidden[: end - first].clone())
        for cache in decoder.caches:
            cache.length = past + end
    return torch.cat(out)


def tree_rows(decoder: LeanDecoder, block: Block, layers: tuple[int, ...] = ()) -> torch.Tensor:
    """A token tree on fixed buffers, branch by branch: each root-to-leaf path runs as a chain
    (its nodes at the slots and positions a one-token step gives them, so each row's attention
    sums its keys in the same places), then every node's keys and values go to the slot of its
    index in the block, as a tree pass leaves them. Exact; one pass per leaf."""
    past, n = decoder.length, block.tokens.shape[0]
    sees = block.mask[:, past:].cpu()  # [n, n] bool: node i sees node j (its ancestors, itself)
    paths = [torch.nonzero(sees[i]).flatten().tolist() for i in range(n)]
    inner = {node for path in paths for node in path[:-1]}
    positions = (torch.arange(past, past + n, device=block.tokens.device) if block.positions is None
                 else block.positions)
    hidden: list[torch.Tensor | None] = [None] * n
    entries: list[list[tuple[torch.Tensor, torch.Tensor]] | None] = [None] * n  # per node, per layer
    for leaf in (i for i in range(n) if i not in inner):
        path = paths[leaf]
        decoder.rewind(past)
        out = static_rows(decoder, Block(block.tokens[path], positions[path]), layers)
        for depth, node in enumerate(path):
            if hidden[node] is None:
                hidden[node] = out[depth]
                entries[node] = [(c.keys[:, :, past + depth].clone(), c.values[:, :, past + depth].clone())
                                 for c in decoder.caches]
    for layer, cache in enumerate(decoder.caches):
        cache.keys[:, :, past: past + n] = torch.stack([entries[i][layer][0] for i in range(n)], dim=2)
        cache.values[:, :, past: past + n] = torch.stack([entries[i][layer][1] for i in range(n)], dim=2)
        cache.length = past + n
    return torch.stack(hidden)


def static_forward(w: LeanWeights, caches: list[KVCache], passes: StaticPasses,
                   layers: tuple[int, ...] = ()) -> torch.Tensor:
    """One fixed-shape pass over the rows loaded in `passes` (tokens, positions, write slots and
    masks, all static buffers): every product and norm at exactly FIXED_ROWS rows, keys and values
    written by index into the caches' fixed buffers, each row attending over the whole buffer
    through its mask. No shape and no Python number here changes between steps, so a CUDA graph
    of it replays any step. Returns [FIXED_ROWS, hidden * (1 + len(layers))] (as forward_rows)."""
    count = passes.rows
    x = w.embed(passes.tokens)[None]  # [1, rows, hidden]
    rotary = {kind: w.rotary_tables(x, passes.positions, kind) for kind in {layer.kind for layer in w.layers}}
    q_size = w.heads * w.head_dim

    def run(f: Product | None, h: torch.Tensor) -> torch.Tensor:  # h: [1, rows, in]
        return h if f is None else at_fixed_rows(f, h)

    captured = []
    for index, layer in enumerate(w.layers):
        if index in layers:
            captured.append(x[0])
        q, k, v = split_heads(w, layer, run(layer.qkv, run(layer.attn_norm, x)), *rotary[layer.kind], run)
        cache = caches[index]
        cache.keys.index_copy_(2, passes.slots, k)
        cache.values.index_copy_(2, passes.slots, v)
        attended = pass_attention(q, cache.keys, cache.values, passes.biases[layer.window], w.scaling)
        x = x + run(layer.attn_post_norm, run(layer.out, attended.transpose(1, 2).reshape(1, count, q_size)))
        gate, up = run(layer.gate_up, run(layer.mlp_norm, x)).chunk(2, dim=-1)
        x = x + run(layer.mlp_post_norm, run(layer.down, w.activation(gate) * up))
    normed = run(w.norm, x)[0]
    return torch.cat([normed, *captured], dim=-1) if captured else normed


def row_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None,
                  scale: float, gqa: bool, window: int | None = None) -> torch.Tensor:
    """Attention of each query row over exactly the keys it sees, in cache order, one row at a
    time: the same call, on the same keys, as the one-token step at that position makes.

    SDPA over a block (or over extra masked keys) rounds differently from SDPA over the one
    query (measured here, float32: scripts/invariance_probe.py); the linear products (prepacked,
    int4) are row-invariant already, so this makes the whole forward independent of the block.
    q: [1, heads, n, head_dim]; keys, values: [1, kv_heads, length, head_dim]; mask: [n, length]
    bool (True = attend; its window applied) or None (causal: row i sees the first
    length - n + i + 1 keys, of which the last `window` where given). Returns [1, n, heads * head_dim].
    """
    n, length = q.shape[2], keys.shape[2]
    rows = []
    for i in range(n):
        if mask is None:
            end = length - n + i + 1
            start = 0 if window is None else max(0, end - window)
            seen_keys, seen_values = keys[:, :, start:end], values[:, :, start:end]
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
        # Invariant on a GPU: fixed KV buffers and fixed-shape passes (static_rows), CUDA graphs.
        self.passes: StaticPasses | None = None
        if invariant and weights.fixed_rows:
            # the last slot is the padding rows' scratch; a multiple of 64 keeps the mask aligned
            capacity = -(-(weights.static_keys + 1) // 64) * 64
            self.passes = StaticPasses(FIXED_ROWS, capacity, {layer.window for layer in weights.layers},
                                       weights.embed.weight.dtype, torch.device(device),
                                       graphs_enabled(torch.device(device)))
            for cache in self.caches:
                cache.reserve(weights.kv_heads, capacity, weights.head_dim, weights.embed.weight.dtype,
                              device)

    @classmethod
    def of(cls, model: PreTrainedModel) -> LeanDecoder:
        """A decoder over `model`'s own (prepacked float) weights."""
        return cls(LeanWeights.of(model), model.device)

    @property
    def length(self) -> int:
        return self.caches[0].length

    def reset(self) -> None:
        """Empty the cache and free its buffers (a finished sequence's cache holds no memory);
        fixed buffers (a GPU's, which its CUDA graphs read) are kept, emptied."""
        if self.passes is not None:
            self.rewind(0)
            return
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
        n = hidden.shape[0]
        if self.invariant and n < self.weights.min_rows["head"]:
            return self.weights.head(pad_rows(hidden, self.weights.min_rows["head"]))[:n]
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
