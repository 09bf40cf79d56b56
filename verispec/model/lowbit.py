"""Low-precision copies of a model's linear weights, and the kernels that multiply by them.

Self-speculation drafts with the target's own weights in int4, int8 or bfloat16 (QSpec, ML-SpecQD):
no training, any Llama-shaped model, and top-1 agreement with the float32 target near 97-99%. A
one-token step reads every weight once, so on a CPU its cost follows the bytes read: int4 weights
are an eighth of float32's.

Formats (the values a weight holds):
- int4: groups of `group` input columns share a scale and a minimum: w = code * scale + min,
  code in 0..15 (GGUF's Q4_1 layout; Q4_0 is min = -8 * scale).
- int8: one scale per output row: w = code * scale, code in -127..127.
- bf16: the weight rounded to bfloat16.

Kernels (how a product runs) depend on the machine: verispec's row kernels (kernels/rows.cpp:
every format, `int4-rows`, `int8-rows`, `bf16-rows`) where they run; torch's CPU integer kernels,
fast with bfloat16 activations where the CPU has native bfloat16 and several times slower with
float32 ones; oneDNN's bfloat16. `choose_kernel` times the candidates on weights of the model's shapes
and keeps the fastest, once per machine: the choice is cached beside the row kernels' (keyed by
CPU model and flags, torch, the kernels' build, threads and the shapes); `Kernel.name` says
which ran.

A GGUF file stored in Q4_0 or Q4_1 already holds int4 groups of 32: `gguf_int4` takes those
blocks as they are instead of quantizing the dequantized weights again.

A 4-bit *target* (`load_model(dtype="int4")`, `int4_target`) replaces the decoder layers' linear
modules with `QuantLinear`s over those blocks (a Hugging Face model: its weights quantized to
groups of 32 at load); the embedding and the LM head keep the weights they were loaded with, as
llama.cpp's Q4 files keep them at higher precision.
"""

from __future__ import annotations

import functools
import hashlib
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from verispec.core.errors import VerispecError
from verispec.core.files import write_json
from verispec.model.gguf_file import gguf_tensors
from verispec.model.kernels import rows
from verispec.model.packed import cpu_packs, pack_weight, packed_linear

FORMATS = ("int4", "int8", "bf16")
INT4_GROUPS = (32, 64, 128)


@dataclass(frozen=True)
class Int4Groups:
    """Group-wise asymmetric 4-bit weights: w[n, k] = codes[n, k] * scales[n, g] + mins[n, g]
    with g = k // group."""

    codes: torch.Tensor  # [out, in] uint8 in 0..15
    scales: torch.Tensor  # [out, in // group] float32
    mins: torch.Tensor  # [out, in // group] float32

    @property
    def group(self) -> int:
        return self.codes.shape[1] // self.scales.shape[1]

    @classmethod
    def quantize(cls, weight: torch.Tensor, group: int) -> Int4Groups:
        """weight [out, in] -> nearest codes over each group's [min, max] range (as Q4_1 does).

        >>> Int4Groups.quantize(torch.tensor([[0.0, 1.2, 2.8, 15.0]]), 4).dequantize()
        tensor([[ 0.,  1.,  3., 15.]])
        """
        out_features, in_features = weight.shape
        if in_features % group:
            raise VerispecError(f"int4 groups of {group} need the input width ({in_features}) "
                                f"to be a multiple of {group}")
        grouped = weight.detach().float().reshape(out_features, in_features // group, group)
        low, high = grouped.amin(-1), grouped.amax(-1)
        scales = (high - low) / 15
        inverse = torch.where(scales == 0, 0.0, 1 / scales)
        codes = ((grouped - low[..., None]) * inverse[..., None]).round().clamp(0, 15)
        return cls(codes.to(torch.uint8).reshape(out_features, in_features), scales, low)

    def dequantize(self) -> torch.Tensor:
        """The weights these codes stand for: [out, in] float32."""
        grouped = self.codes.float().reshape(*self.scales.shape, self.group)
        return (grouped * self.scales[..., None] + self.mins[..., None]).reshape(self.codes.shape)

    def rows(self, index: torch.Tensor) -> Int4Groups:
        """The output rows `index` [m] (a row permutation, say)."""
        return Int4Groups(self.codes[index], self.scales[index], self.mins[index])

    @staticmethod
    def cat(parts: Sequence[Int4Groups]) -> Int4Groups:
        """Several weights over the same input stacked by rows (a fused product)."""
        if len({p.group for p in parts}) != 1:
            raise VerispecError("int4 weights fused into one product need one group size")
        return Int4Groups(*(torch.cat([getattr(p, f) for p in parts]) for f in ("codes", "scales", "mins")))


@dataclass(frozen=True)
class Int8Channels:
    """Per-output-row symmetric 8-bit weights: w[n, k] = codes[n, k] * scales[n]."""

    codes: torch.Tensor  # [out, in] int8
    scales: torch.Tensor  # [out] float32

    @classmethod
    def quantize(cls, weight: torch.Tensor) -> Int8Channels:
        """weight [out, in] -> codes scaled so each row's largest magnitude is 127."""
        weight = weight.detach().float()
        scales = weight.abs().amax(-1) / 127
        inverse = torch.where(scales == 0, 0.0, 1 / scales)
        return cls((weight * inverse[:, None]).round().clamp(-127, 127).to(torch.int8), scales)

    def dequantize(self) -> torch.Tensor:
        return self.codes.float() * self.scales[:, None]


@dataclass(frozen=True)
class Int8Groups:
    """Group-wise symmetric 8-bit weights: w[n, k] = codes[n, k] * scales[n, k // group] (GGUF's
    Q8_0 with groups of 32, the built-in model's LM head)."""

    codes: torch.Tensor  # [out, in] int8 in -127..127
    scales: torch.Tensor  # [out, in // group] float32

    @classmethod
    def quantize(cls, weight: torch.Tensor, group: int = 32) -> Int8Groups:
        """weight [out, in] -> codes scaled so each group's largest magnitude is 127 (Q8_0).

        >>> Int8Groups.quantize(torch.tensor([[127.0, -63.4, 0.2, 1.0]]), 2).codes
        tensor([[127, -63,  25, 127]], dtype=torch.int8)
        """
        out_features, in_features = weight.shape
        if in_features % group:
            raise VerispecError(f"int8 groups of {group} need the input width ({in_features}) "
                                f"to be a multiple of {group}")
        grouped = weight.detach().float().reshape(out_features, in_features // group, group)
        scales = grouped.abs().amax(-1) / 127
        codes = (grouped / torch.where(scales == 0, 1.0, scales)[..., None]).round().clamp(-127, 127)
        return cls(codes.to(torch.int8).reshape(weight.shape), scales)

    @classmethod
    def exact(cls, weight: torch.Tensor, group: int = 32) -> Int8Groups | None:
        """The groups that give exactly `weight` [out, in] (a Q8_0 tensor loaded as floats: each
        group's scale is its largest magnitude / 127), or None if it is not on such a grid."""
        out_features, in_features = weight.shape
        if in_features % group:
            return None
        found = cls.quantize(weight, group)
        return found if torch.equal(found.dequantize(), weight.detach().float()) else None

    def dequantize(self) -> torch.Tensor:
        """The weights these codes stand for: [out, in] float32."""
        group = self.codes.shape[1] // self.scales.shape[1]
        grouped = self.codes.float().reshape(*self.scales.shape, group)
        return (grouped * self.scales[..., None]).reshape(self.codes.shape)


Quantized = Int4Groups | Int8Channels | Int8Groups | torch.Tensor  # a bf16 weight is a plain tensor


def quantize(weight: torch.Tensor, fmt: str, group: int = 32) -> Quantized:
    """weight [out, in] in format `fmt` (FORMATS)."""
    if fmt == "int4":
        return Int4Groups.quantize(weight, group)
    if fmt == "int8":
        return Int8Channels.quantize(weight)
    if fmt == "bf16":
        return weight.detach().to(torch.bfloat16)
    raise VerispecError(f"unknown weight format {fmt!r}; choose from {', '.join(FORMATS)}")


def fuse(parts: Sequence[Quantized]) -> Quantized:
    """Weights over the same input stacked by rows, in their common format (a format with its
    own `cat`, such as Int4Groups or gguf_blocks.Blocks, stacks its own)."""
    if isinstance(parts[0], Int8Channels | Int8Groups):
        return type(parts[0])(torch.cat([p.codes for p in parts]), torch.cat([p.scales for p in parts]))
    if isinstance(parts[0], torch.Tensor):
        return torch.cat(list(parts))
    return type(parts[0]).cat(parts)


def dequantize(weight: Quantized) -> torch.Tensor:
    return weight.float() if isinstance(weight, torch.Tensor) else weight.dequantize()


# ---- kernels ---------------------------------------------------------------------------------


class Kernel:
    """x [..., in] (any float dtype) -> x @ w.T [..., out] in x's dtype, for one stored weight."""

    name: str
    nbytes: int  # memory the stored weight takes

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        out = self.matmul(x.reshape(-1, shape[-1]))
        out = out.reshape(*shape[:-1], out.shape[-1])
        return out if out.dtype == x.dtype else out.to(x.dtype)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:  # x: [rows, in]
        raise NotImplementedError


class RowKernel(Kernel):
    """A weight through verispec's row kernels (kernels/rows.cpp), which take any leading
    dimensions: no reshape around the call (each a Python-level op, ~1-2 us of a one-token
    step's ~150 products and attentions)."""

    product: rows.CodesProduct | rows.DenseProduct

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        out = self.product(x)  # [..., out]
        return out if out.dtype == x.dtype else out.to(x.dtype)

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        return self.product(x)


class Int4Kernel(Kernel):
    """torch's CPU int4 product: codes packed at load (the layout depends on the CPU, so it is
    never cached on disk); scales and zeros in the activation dtype, w = (code - 8) * scale + zero."""

    def __init__(self, weight: Int4Groups, activations: torch.dtype) -> None:
        self.group, self.activations = weight.group, activations
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(weight.codes.to(torch.int32), 1)
        zeros = weight.mins + 8 * weight.scales
        pairs = torch.stack([weight.scales, zeros], -1)  # [out, in // group, 2]
        self.scales_zeros = pairs.transpose(0, 1).contiguous().to(activations)  # [in // group, out, 2]
        self.nbytes = _nbytes(self.packed, self.scales_zeros)
        self.name = f"int4 g{self.group} (aten int4pack, {_dtype(activations)} activations)"

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x.to(self.activations), self.packed, self.group,
                                                          self.scales_zeros)


class RowsInt4Kernel(RowKernel):
    """verispec's own row kernel (kernels/rows.cpp, this process's class): each weight tile unpacked once
    for every row, each row's arithmetic independent of the others (row-invariant from one row
    on); activations rounded to bfloat16, scales and minimums in float32, float32 out."""

    def __init__(self, weight: Int4Groups) -> None:
        self.group = weight.group
        self.product = rows.CodesProduct(weight.codes, weight.scales, weight.mins)
        self.nbytes = self.product.nbytes
        self.name = f"int4 g{self.group} ({rows.name()}, bfloat16 activations)"


class RowsInt8Kernel(RowKernel):
    """8-bit weights through verispec's row kernel: one byte a weight plus its group's scale
    (Int8Groups) or its row's (Int8Channels: the row's scale repeated over groups of 32, the same
    weights), float32 out."""

    def __init__(self, weight: Int8Groups | Int8Channels) -> None:
        if isinstance(weight, Int8Groups):
            scales, grouping = weight.scales, f"g{weight.codes.shape[1] // weight.scales.shape[1]}"
        else:
            scales, grouping = weight.scales[:, None], "per row"  # one group as wide as the row
        self.product = rows.CodesProduct(weight.codes, scales, None, bits=8)
        self.nbytes = self.product.nbytes
        self.name = f"int8 {grouping} ({rows.name()}, bfloat16 activations)"


class RowsDenseKernel(RowKernel):
    """A bfloat16 weight through verispec's row kernel (kernels/rows.cpp): float32 accumulation,
    out in the activations' dtype (a 4-bit target's float32 logits are not rounded to bfloat16)."""

    def __init__(self, weight: torch.Tensor) -> None:
        self.product = rows.DenseProduct(weight)
        self.nbytes = self.product.nbytes
        self.name = self.product.name


class Int8Kernel(Kernel):
    """torch's CPU int8 weight-only product (per-channel scales in the activation dtype)."""

    def __init__(self, weight: Int8Channels, activations: torch.dtype) -> None:
        self.codes, self.activations = weight.codes.contiguous(), activations
        self.scales = weight.scales.to(activations)
        self.nbytes = _nbytes(self.codes, self.scales)
        self.name = f"int8 (aten int8pack, {_dtype(activations)} activations)"

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.aten._weight_int8pack_mm(x.to(self.activations), self.codes, self.scales)


class DenseKernel(Kernel):
    """A dense weight in `dtype`, prepacked for oneDNN where the CPU packs that dtype."""

    def __init__(self, weight: torch.Tensor, dtype: torch.dtype, prepack: bool) -> None:
        self.dtype = dtype
        self.weight = weight.detach().to(dtype).contiguous()
        self.packed = pack_weight(self.weight) if prepack else None
        if self.packed is not None:  # the packed copy is the one products read
            self.weight = None
        self.nbytes = _nbytes(self.weight if self.packed is None else self.packed)
        self.name = f"{_dtype(dtype)} ({'oneDNN prepacked' if prepack else 'F.linear'})"

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        x = x.to(self.dtype)
        if self.packed is not None:
            return packed_linear(x, self.packed, None)
        return torch.nn.functional.linear(x, self.weight)


class RescoredHead:
    """An LM head whose low-precision logits choose the candidates and the full-precision weight
    scores them: the `top` largest approximate logits of each row are replaced by exact dot
    products with the original rows (gathered, [top, hidden] each). The argmax is then the
    original head's whenever it is among the approximate top, which on SmolLM2's int4 head
    lifted top-1 agreement with the target from 0.89 to the level of a float head.

    Under sampling these logits are still one fixed function of the hidden state, so the q
    drawn from them is exact as a draft distribution."""

    def __init__(self, approximate: Kernel, weight: torch.Tensor, top: int) -> None:
        self.approximate, self.weight, self.top = approximate, weight.detach(), top  # weight: [vocab, hidden]
        self.name = f"{approximate.name}, top {top} rescored at full precision"
        self.nbytes = approximate.nbytes  # the full weight is the target's, shared

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        # x: [n, hidden] -> logits [n, vocab] in x's dtype
        logits = self.approximate(x)
        index = logits.topk(self.top, dim=-1).indices  # [n, top]
        exact = (self.weight[index] @ x.to(self.weight.dtype)[:, :, None])[..., 0]  # [n, top]
        return logits.scatter(-1, index, exact.to(logits.dtype))


class QuantLinear(nn.Module):
    """A linear layer that multiplies by a stored low-precision weight through a kernel: the
    layers (and head) of a 4-bit target. Its forward serves models run through their own Hugging
    Face forward; the lean path fuses the stored weights of q/k/v and gate/up (`fused`)."""

    def __init__(self, stored: Quantized, kernel: Callable[[Quantized], Kernel],
                 bias: torch.Tensor | None) -> None:
        super().__init__()
        shape = (stored if isinstance(stored, torch.Tensor) else stored.codes).shape
        self.out_features, self.in_features = shape
        self.stored, self.build, self.bias = stored, kernel, bias
        self.kernel = kernel(stored)

    @property
    def weight(self) -> torch.Tensor:
        """The weights the stored values stand for, [out, in] float32 (computed on each read: for
        code that reads a layer's weights once, such as drafters built from the target)."""
        return dequantize(self.stored)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [..., in_features] -> [..., out_features]
        out = self.kernel(x)
        return out if self.bias is None else out + self.bias.to(out.dtype)

    @staticmethod
    def fused(layers: Sequence[QuantLinear]) -> Kernel:
        """One kernel over several layers' stored weights (outputs concatenated), without their
        biases (the caller adds them: verispec.model.lean.with_bias). One layer: its own kernel."""
        if len(layers) == 1:
            return layers[0].kernel
        return layers[0].build(fuse([layer.stored for layer in layers]))


def int4_target(model: nn.Module, gguf: Path | None) -> str:
    """Turn `model` (float, loaded from `gguf` if given) into a 4-bit target in place and return
    what its products run on, for reports.

    Every decoder layer's nn.Linear becomes a QuantLinear over the file's Q4_0 / Q4_1 blocks where
    they are exactly the loaded weights, else over the weights quantized to groups of 32, through
    the fastest 4-bit kernel on this machine (`choose_kernel`). The LM head (a GGUF's Q8_0 or
    float head; llama.cpp keeps it above 4 bits too) runs in bfloat16 where the CPU packs it, less
    than half float32's time (docs/performance.md, "Figures behind the target's design")."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None:
        raise VerispecError(f"a 4-bit target needs a decoder with model.layers; "
                            f"{type(model).__name__} has none")
    if next(model.parameters()).device.type != "cpu":
        raise VerispecError("the 4-bit target runs on CPU (torch's int4 kernels)")
    linears = [(name, module) for name, module in layers.named_modules() if isinstance(module, nn.Linear)]
    if any(module.in_features % Q4_BLOCK for _, module in linears):
        raise VerispecError(f"a 4-bit target needs every layer's input width to be a multiple of {Q4_BLOCK}")
    if any(module.out_features % 16 for _, module in linears):  # torch's int4 packing: rows of 16
        raise VerispecError("a 4-bit target needs every layer's output width to be a multiple of 16")
    blocks = gguf_int4(gguf, model.config) if gguf is not None else {}
    shapes = tuple(sorted({(m.out_features, m.in_features) for _, m in linears}))
    # The row kernel where it runs: a target's kernel is its arithmetic, so it is not left to a
    # timing that may differ from one process to the next; else the fastest of torch's.
    found = candidates("int4", torch.device("cpu"))
    build = found["int4-rows"] if "int4-rows" in found else found[choose_kernel("int4", shapes, Q4_BLOCK,
                                                                               only="int4")]
    for name, module in linears:
        stored = blocks.get(f"model.layers.{name}.weight")
        if stored is None or not torch.equal(stored.dequantize(), module.weight.detach().float()):
            stored = Int4Groups.quantize(module.weight, Q4_BLOCK)
        parent, _, child = name.rpartition(".")
        quantized = QuantLinear(stored, build, None if module.bias is None else module.bias.detach())
        setattr(layers.get_submodule(parent), child, quantized)
    described = f"layers {quantized.kernel.name}"
    head = model.get_output_embeddings()
    bias = None if getattr(head, "bias", None) is None else head.bias.detach()
    q8 = Int8Groups.exact(head.weight) if isinstance(head, nn.Linear) and rows.available() else None
    if q8 is not None and rows.fits(*q8.codes.shape):
        # a GGUF's Q8_0 head as its own blocks: half the bytes of bfloat16, and exactly its values
        model.set_output_embeddings(QuantLinear(q8, RowsInt8Kernel, bias))
        model.config.tie_word_embeddings = False  # the head no longer shares the embedding's tensor
        described += f", head {model.get_output_embeddings().kernel.name}"
    elif isinstance(head, nn.Linear) and (cpu_packs(torch.bfloat16) or rows.available()):
        stored = head.weight.detach().to(torch.bfloat16)
        model.set_output_embeddings(QuantLinear(stored, bfloat16_kernel, bias))
        model.config.tie_word_embeddings = False  # the head no longer shares the embedding's tensor
        described += f", head {model.get_output_embeddings().kernel.name}"
    return described


def bfloat16_kernel(weight: torch.Tensor) -> Kernel:
    """The fastest product over a bfloat16 weight [out, in] here: the row kernel where it runs and
    fits the shape, else oneDNN (prepacked where this CPU packs bfloat16)."""
    if rows.available() and rows.fits(*weight.shape):
        return RowsDenseKernel(weight)
    return DenseKernel(weight, torch.bfloat16, cpu_packs(torch.bfloat16))


def weight_format(model: nn.Module) -> str:
    """What a target's layers run in: "int4" for a 4-bit target, "gguf" for a GGUF file's own
    blocks (verispec.model.gguf_blocks), else its parameters' dtype."""
    stored = [module.stored for module in model.modules() if isinstance(module, QuantLinear)]
    if any(isinstance(weight, Int4Groups) for weight in stored):
        return "int4"
    if any(hasattr(weight, "qtype") for weight in stored):
        return "gguf"
    return _dtype(next(model.parameters()).dtype)


def _nbytes(*tensors: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _dtype(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def candidates(fmt: str, device: torch.device) -> dict[str, Callable[[Quantized], Kernel]]:
    """The ways this machine can multiply by a weight stored in `fmt`, by a short label."""
    if device.type != "cpu":
        raise VerispecError(f"low-precision drafting runs on CPU; this model is on {device.type}")
    bf16 = torch.bfloat16
    found: dict[str, Callable[[Quantized], Kernel]] = {}
    if fmt == "int4":
        if rows.available():
            found["int4-rows"] = lambda w: (RowsInt4Kernel(w) if rows.fits(*w.codes.shape)
                                            else Int4Kernel(w, bf16))
        found["int4-bf16"] = lambda w: Int4Kernel(w, bf16)
        found["int4-f32"] = lambda w: Int4Kernel(w, torch.float32)
    elif fmt == "int8":
        if rows.available():
            found["int8-rows"] = lambda w: (RowsInt8Kernel(w) if rows.fits(*w.codes.shape)
                                            else Int8Kernel(w, bf16))
        found["int8-bf16"] = lambda w: Int8Kernel(w, bf16)
        found["int8-f32"] = lambda w: Int8Kernel(w, torch.float32)
    elif fmt != "bf16":
        raise VerispecError(f"unknown weight format {fmt!r}; choose from {', '.join(FORMATS)}")
    if fmt == "bf16" and rows.available():
        found["bf16-rows"] = lambda w: bfloat16_kernel(dequantize(w))
    if cpu_packs(bf16):  # the same values rounded to bfloat16 (twice the int8 bytes)
        found["bf16-packed"] = lambda w: DenseKernel(dequantize(w), bf16, True)
    found["bf16"] = lambda w: DenseKernel(dequantize(w), bf16, False)
    return found


# Weights the probe cycles through, so that they come from memory as in a real model, not cache.
PROBE_BYTES = 96 * 2**20


@functools.cache
def choose_kernel(fmt: str, shapes: tuple[tuple[int, int], ...], group: int = 32,
                  device: str = "cpu", only: str = "") -> str:
    """The label (a key of `candidates`) of the fastest one-row kernel for weights of `shapes`
    [(out, in), ...] in `fmt` on this machine, among the labels starting with `only`: the one
    cached for this machine (`choice_file`), else measured (`time_kernels`) and cached. Loading
    a model does not pay the measurement again (seconds: 3.8 s for SmolLM2's layers and head, 7.5
    s for Gemma 3's 262k-row head alone, on a 2-core EPYC)."""
    options = {label: build for label, build in candidates(fmt, torch.device(device)).items()
               if label.startswith(only)}
    if len(options) == 1:
        return next(iter(options))
    path = choice_file(fmt, shapes, group, device, sorted(options))
    try:
        label = json.loads(path.read_text())["label"]
        if label in options:
            return label
    except (OSError, ValueError, KeyError, TypeError):
        pass
    label = time_kernels(fmt, shapes, group, options)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_json(path, {"label": label, "format": fmt, "shapes": shapes}, indent=None)
    except OSError:
        pass
    return label


def choice_file(fmt: str, shapes: tuple[tuple[int, int], ...], group: int, device: str,
                labels: list[str]) -> Path:
    """Where the choice among `labels` is cached: named by everything it depends on (the CPU,
    torch, the row kernels' build and class, torch's threads, the weights' format, shapes and
    group)."""
    kernels = rows.choice().name if rows.available() else None  # the class int4-rows runs on
    key = f"{rows.cpu_key()}|{kernels}|{torch.get_num_threads()}|{fmt}|{shapes}|{group}|{device}|{labels}"
    return rows.cache_dir() / f"lowbit-{hashlib.sha1(key.encode()).hexdigest()[:16]}.json"


def time_kernels(fmt: str, shapes: tuple[tuple[int, int], ...], group: int,
                 options: dict[str, Callable[[Quantized], Kernel]]) -> str:
    """The label of the fastest of `options` over one row: random weights of `shapes`, enough
    copies to exceed the CPU's caches, the best of 5 passes after a warm-up."""
    generator = torch.Generator().manual_seed(0)
    stored = [quantize(torch.randn(shape, generator=generator), fmt, group) for shape in shapes]
    inputs = [torch.randn(1, shape[1], generator=generator) for shape in shapes]
    sets, best = {}, {}
    for label, build in options.items():
        per_copy = sum(dequantize(w).numel() for w in stored) * _bytes_per_weight(label)
        copies = max(1, min(16, int(PROBE_BYTES // max(per_copy, 1))))
        sets[label] = [[build(w) for w in stored] for _ in range(copies)]
    for repeat in range(6):  # candidates in turn, so that the machine's drifts hit all alike
        for label, kernel_sets in sets.items():
            started = time.perf_counter()
            for kernels in kernel_sets:
                for kernel, x in zip(kernels, inputs):
                    kernel(x)
            if repeat:  # the first pass warms up
                seconds = (time.perf_counter() - started) / len(kernel_sets)
                best[label] = min(best.get(label, seconds), seconds)
    return min(best, key=best.get)


def _bytes_per_weight(label: str) -> float:
    return {"int4": 0.5, "int8": 1.0}.get(label.split("-")[0], 2.0)


# ---- GGUF blocks -------------------------------------------------------------------------------

# Hugging Face parameter names of a Llama layer's linear weights, by GGUF tensor name.
GGUF_LINEARS = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
                "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
                "ffn_down": "mlp.down_proj"}
Q4_BLOCK = 32


def q4_blocks(raw, qtype: str, rows: int, columns: int) -> Int4Groups:
    """GGUF Q4_0 / Q4_1 blocks -> Int4Groups with groups of 32, values exactly as gguf-py and
    transformers dequantize them (Q4_1: w = d * q + m; Q4_0: w = d * (q - 8)).

    raw: uint8 [rows, columns // 32 * block_bytes]. A block is fp16 d (Q4_1: then fp16 m), then 16
    bytes whose low nibbles are the block's first 16 codes and high nibbles the last 16.
    """
    data = torch.tensor(raw).reshape(rows, columns // Q4_BLOCK, -1)  # a copy: the file is read-only
    header = 4 if qtype == "Q4_1" else 2
    d = data[..., :2].contiguous().view(torch.float16)[..., 0].float()  # [rows, groups]
    mins = data[..., 2:4].contiguous().view(torch.float16)[..., 0].float() if qtype == "Q4_1" else -8 * d
    packed = data[..., header:]  # [rows, groups, 16]
    codes = torch.cat([packed & 0x0F, packed >> 4], dim=-1).reshape(rows, columns)
    return Int4Groups(codes, d, mins)


def llama_q_k_rows(rows: int, heads: int) -> torch.Tensor:
    """The row order transformers gives GGUF's q / k weights: llama.cpp stores each head's rotary
    halves interleaved, and transformers undoes that on load. Returns, for each Hugging Face row,
    the GGUF row it comes from."""
    half = rows // heads // 2
    return torch.arange(rows).reshape(heads, half, 2).transpose(1, 2).reshape(rows)


def gguf_int4(path: Path, config) -> dict[str, Int4Groups]:
    """The Q4_0 / Q4_1 linear weights of a Llama GGUF file, by Hugging Face parameter name
    (model.layers.N.self_attn.q_proj.weight ...), rows in Hugging Face's order. Weights stored in
    any other type are left out (they are quantized from the loaded weights instead)."""
    architecture, tensors = gguf_tensors(path)
    if architecture != "llama":
        return {}
    heads = int(config.num_attention_heads)
    kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
    found: dict[str, Int4Groups] = {}
    for tensor in tensors.values():
        parts = tensor.name.split(".")  # blk.N.attn_q.weight
        if (len(parts) != 4 or parts[0] != "blk" or parts[2] not in GGUF_LINEARS
                or tensor.qtype not in ("Q4_0", "Q4_1")):
            continue
        columns, rows = tensor.shape[:2]
        weight = q4_blocks(tensor.data, tensor.qtype, rows, columns)
        if parts[2] in ("attn_q", "attn_k"):
            weight = weight.rows(llama_q_k_rows(rows, heads if parts[2] == "attn_q" else kv_heads))
        found[f"model.layers.{parts[1]}.{GGUF_LINEARS[parts[2]]}.weight"] = weight
    return found
