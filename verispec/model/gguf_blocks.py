"""GGUF tensors as their blocks are stored, and a target that runs every tensor in the file's own
quantization (`load_model(dtype="gguf")`).

A K-quant file mixes block types (Gemma 3 270M's Q4_K_M: Q5_0, Q4_K, Q8_0 and Q6_K tensors), and
their scales are not what torch's int4 kernel can hold: it keeps scales in bfloat16, while a Q4_K
group's scale is d * sc (an fp16 times a 6-bit integer, rounded to float32). So every type is read
into one simple form, `Blocks`: integer codes with a float32 scale and minimum per group,
w = code * scale + min, exactly the values gguf-py (and so transformers, and llama.cpp) dequantize
the block to, checked with torch.equal at load.

| type | group | code bits | codes | scale | min |
| --- | ---: | ---: | --- | --- | --- |
| Q4_0 | 32 | 4 | q - 8 | d | 0 |
| Q4_1 | 32 | 4 | q | d | m |
| Q5_0 | 32 | 5 | q - 16 | d | 0 |
| Q5_1 | 32 | 5 | q | d | m |
| Q8_0 | 32 | 8 | q | d | 0 |
| Q4_K | 32 | 4 | q | d * sc | -(dmin * m) |
| Q5_K | 32 | 5 | q | d * sc | -(dmin * m) |
| Q6_K | 16 | 6 | q - 32 | d * sc | 0 |

The products run through the row kernels (verispec/model/kernels: `rows.CodesProduct`, each
type mapped onto its codes, scales and minimums by `ROW_CODES`, activations rounded to bfloat16,
float32 sums) where they run, else through the blocks' values in float32, prepacked for oneDNN
(float32 activations). Either way a kernel is checked when it is built: its products with unit
vectors are the blocks' values, bit for bit. F32, F16 and BF16 tensors keep the float weights
they were loaded with (their values exactly).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import Q4_K, dequantize
from torch import nn

from verispec.core.errors import VerispecError
from verispec.model.gguf_file import TensorInfo, gguf_tensors
from verispec.model.kernels import rows
from verispec.model.lowbit import GGUF_LINEARS, DenseKernel, Int4Groups, Kernel, QuantLinear, llama_q_k_rows
from verispec.model.packed import cpu_packs

# type -> (weights per group, bits per code)
QTYPES: dict[str, tuple[int, int]] = {
    "Q4_0": (32, 4), "Q4_1": (32, 4), "Q5_0": (32, 5), "Q5_1": (32, 5), "Q8_0": (32, 8),
    "Q4_K": (32, 4), "Q5_K": (32, 5), "Q6_K": (16, 6)}
FLOAT_TYPES = ("F32", "F16", "BF16")


@dataclass(frozen=True)
class Blocks:
    """A GGUF tensor's blocks: w[n, k] = codes[n, k] * scales[n, g] + mins[n, g], g = k // group,
    computed in float32 (one product, one sum: the order gguf-py dequantizes in)."""

    codes: torch.Tensor  # [out, in] int8
    scales: torch.Tensor  # [out, in // group] float32
    mins: torch.Tensor  # [out, in // group] float32
    bits: int
    qtype: str

    @property
    def group(self) -> int:
        return self.codes.shape[1] // self.scales.shape[1]

    def dequantize(self) -> torch.Tensor:
        """The weights the blocks stand for: [out, in] float32."""
        grouped = self.codes.float().reshape(*self.scales.shape, self.group)
        return (grouped * self.scales[..., None] + self.mins[..., None]).reshape(self.codes.shape)

    def columns(self, index: torch.Tensor) -> torch.Tensor:
        """The weights of the input columns `index` [m]: [out, m] float32, as dequantize gives them."""
        group = index // self.group
        return self.codes[:, index].float() * self.scales[:, group] + self.mins[:, group]

    @staticmethod
    def cat(parts: Sequence[Blocks]) -> Blocks | Fused:
        """Several tensors over the same input stacked by rows (a fused product): one Blocks
        where they share a type, else each in its own (Fused)."""
        if len({(p.qtype, p.group) for p in parts}) != 1:
            return Fused(tuple(parts))
        return Blocks(*(torch.cat([getattr(p, f) for p in parts]) for f in ("codes", "scales", "mins")),
                      parts[0].bits, parts[0].qtype)

    def int4(self) -> Int4Groups | None:
        """The same values as 4-bit groups (codes 0..15, a scale and a minimum per group of 32:
        Q4_0's q - 8 as q with minimum -8 d, exactly), for drafters that take a target's own
        4-bit codes; None for wider codes or groups of another size."""
        if self.bits != 4 or self.group != 32:
            return None
        offset = ROW_CODES[self.qtype][0]
        codes = (self.codes + offset).to(torch.uint8)
        return Int4Groups(codes, self.scales, self.mins - offset * self.scales)

    def rows(self, index: torch.Tensor) -> Blocks:
        """The output rows `index` [m] (a row permutation, say)."""
        return Blocks(self.codes[index], self.scales[index], self.mins[index], self.bits, self.qtype)


@dataclass(frozen=True)
class Fused:
    """Tensors of several types over the same input, stacked by rows (a fused product such as
    q/k/v where v is stored in another type): each part keeps its own blocks."""

    parts: tuple[Blocks, ...]

    @property
    def types(self) -> str:
        return "+".join(dict.fromkeys(p.qtype for p in self.parts))

    def dequantize(self) -> torch.Tensor:
        """The weights the parts stand for, stacked: [out, in] float32."""
        return torch.cat([p.dequantize() for p in self.parts])

    def columns(self, index: torch.Tensor) -> torch.Tensor:
        """The weights of the input columns `index` [m]: [out, m] float32."""
        return torch.cat([p.columns(index) for p in self.parts])


def _f16(raw: np.ndarray) -> np.ndarray:
    """Two bytes per row, [n, 2] uint8 -> [n, 1] float32."""
    return raw.copy().view(np.float16).astype(np.float32)


def _nibbles(raw: np.ndarray, chunk: int) -> np.ndarray:
    """Bytes [n, m] -> 4-bit codes [n, 2 * m]: each run of `chunk` bytes gives its low nibbles,
    then its high ones (GGML's order: runs of 16 bytes in Q4_0, 32 in Q4_K, 64 in Q6_K)."""
    n, m = raw.shape
    halves = raw.reshape(n, -1, 1, chunk) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    return (halves & 0x0F).reshape(n, 2 * m)


def decode_blocks(raw: np.ndarray, qtype: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Blocks of one type, [n, type_size] uint8 -> codes [n, block] int8, scales and mins
    [n, block // group] float32."""
    n = raw.shape[0]
    if qtype in ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"):
        d = _f16(raw[:, :2])
        header = 4 if qtype in ("Q4_1", "Q5_1") else 2
        mins = _f16(raw[:, 2:4]) if header == 4 else np.zeros_like(d)
        if qtype == "Q8_0":
            return raw[:, 2:].copy().view(np.int8), d, mins
        body = raw[:, header:]
        if qtype.startswith("Q5"):
            high = body[:, :4].copy().view(np.uint32) >> np.arange(32, dtype=np.uint32)[None]
            q = _nibbles(body[:, 4:], 16) | ((high & 1).astype(np.uint8) << 4)
        else:
            q = _nibbles(body, 16)
        offset = {"Q4_0": 8, "Q5_0": 16}.get(qtype, 0)
        return (q.astype(np.int16) - offset).astype(np.int8), d, mins
    if qtype in ("Q4_K", "Q5_K"):
        d, dmin = _f16(raw[:, :2]), _f16(raw[:, 2:4])
        sc, m = Q4_K.get_scale_min(raw[:, 4:16].copy())
        rest = raw[:, 16:]
        if qtype == "Q5_K":
            high = rest[:, :32].reshape(n, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)
            q = _nibbles(rest[:, 32:], 32) | ((high & 1).reshape(n, 256) << 4)
        else:
            q = _nibbles(rest, 32)
        return q.astype(np.int8), d * sc.astype(np.float32), -(dmin * m.astype(np.float32))
    if qtype == "Q6_K":
        low = _nibbles(raw[:, :128], 64)
        shifts = np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)
        high = raw[:, 128:192].reshape(n, 2, 1, 32) >> shifts
        q = low | ((high & 3).reshape(n, 256) << 4)
        scales = _f16(raw[:, 208:210]) * raw[:, 192:208].copy().view(np.int8).astype(np.float32)
        return (q.astype(np.int16) - 32).astype(np.int8), scales, np.zeros_like(scales)
    raise VerispecError(f"GGUF block type {qtype} is not read as stored; types: {', '.join(QTYPES)}")


def read_blocks(raw: np.ndarray, qtype: str, rows: int, columns: int) -> Blocks:
    """A GGUF tensor's data (uint8, [rows, bytes per row]) -> Blocks [rows, columns]."""
    group, bits = QTYPES[qtype]
    size = GGML_QUANT_SIZES[GGMLQuantizationType[qtype]][1]
    codes, scales, mins = decode_blocks(np.asarray(raw, dtype=np.uint8).reshape(-1, size), qtype)
    groups = columns // group
    return Blocks(torch.from_numpy(codes.reshape(rows, columns).copy()),
                  torch.from_numpy(np.ascontiguousarray(scales, dtype=np.float32).reshape(rows, groups)),
                  torch.from_numpy(np.ascontiguousarray(mins, dtype=np.float32).reshape(rows, groups)),
                  bits, qtype)


# ---- kernels ---------------------------------------------------------------------------------

# How each type runs on the row kernels (rows.CodesProduct: w = code * scale + min per group,
# codes of up to 4 bits as nibbles 0..15, wider ones as signed bytes): the offset its codes take
# there (the minimum becoming min - offset * scale: Q4_0's q - 8 runs as q with minimum -8 d,
# the same values exactly) and whether it has minimums (without, the kernel skips their term).
# A type left out of this table runs on its values in float32.
ROW_CODES: dict[str, tuple[int, bool]] = {
    "Q4_0": (8, True), "Q4_1": (0, True), "Q5_0": (0, False), "Q5_1": (0, True), "Q8_0": (0, False),
    "Q4_K": (0, True), "Q5_K": (0, True), "Q6_K": (0, False)}
CHECK_COLUMNS = 256  # unit vectors per product when a kernel is checked (bounds its memory)


@dataclass(frozen=True)
class RowCodes:
    """Blocks as rows.CodesProduct takes them (ROW_CODES applied)."""

    codes: torch.Tensor  # [out, in] int8 (0..15 where bits <= 4)
    scales: torch.Tensor  # [out, in // group] float32
    mins: torch.Tensor | None  # [out, in // group] float32, or None: no minimums
    bits: int

    @classmethod
    def of(cls, blocks: Blocks) -> RowCodes:
        offset, has_mins = ROW_CODES[blocks.qtype]
        mins = blocks.mins - offset * blocks.scales if offset else blocks.mins
        return cls(blocks.codes + offset if offset else blocks.codes, blocks.scales,
                   mins if has_mins else None, blocks.bits)

    @property
    def form(self) -> tuple[bool, int, bool]:
        """What the kernel runs it as: nibbles (else bytes), the group size, minimums or not.
        Parts alike in form stack into one product (Q5_0 and Q8_0 do)."""
        return self.bits <= 4, self.codes.shape[1] // self.scales.shape[1], self.mins is not None

    @staticmethod
    def cat(parts: Sequence[RowCodes]) -> RowCodes:
        """Parts of one form stacked by rows."""
        mins = None if parts[0].mins is None else torch.cat([p.mins for p in parts])
        return RowCodes(torch.cat([p.codes for p in parts]), torch.cat([p.scales for p in parts]), mins,
                        max(p.bits for p in parts))

    def product(self) -> rows.CodesProduct:
        return rows.CodesProduct(self.codes, self.scales, self.mins, self.bits)


class RowsBlocksKernel(Kernel):
    """A GGUF tensor's blocks through verispec's row kernels (kernels/rows.cpp, this process's class): the
    file's codes, scales and minimums as they are, activations rounded to bfloat16, float32 sums,
    each row's arithmetic independent of the other rows (row-invariant by construction). A fused
    product over tensors of several forms (nibbles or bytes, groups of 16 or 32, minimums or not)
    runs one product per run of parts alike, outputs concatenated."""

    def __init__(self, parts: Sequence[Blocks]) -> None:
        runs: list[list[RowCodes]] = []
        for part in map(RowCodes.of, parts):
            if runs and runs[-1][-1].form == part.form:
                runs[-1].append(part)
            else:
                runs.append([part])
        self.products = [RowCodes.cat(run).product() for run in runs]
        self.nbytes = sum(product.nbytes for product in self.products)
        types = "+".join(dict.fromkeys(part.qtype for part in parts))
        self.name = f"{types}: {' + '.join(product.name for product in self.products)}, exact"

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        if len(self.products) == 1:
            return self.products[0](x)
        return torch.cat([product(x) for product in self.products], dim=-1)


class DequantizedKernel(Kernel):
    """A tensor's blocks multiplied as their float32 values, prepacked for oneDNN where the CPU
    packs float32: exact (the weights are the file's values), one float32 copy of them; where the
    row kernels do not run."""

    def __init__(self, stored: Blocks | Fused) -> None:
        self.dense = DenseKernel(stored.dequantize(), torch.float32, cpu_packs(torch.float32))
        self.nbytes = self.dense.nbytes
        kind = stored.qtype if isinstance(stored, Blocks) else stored.types
        self.name = f"{kind}: its values in float32 ({self.dense.name.split('(')[1].rstrip(')')}), exact"

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        return self.dense.matmul(x.float())


def exact_kernel(stored: Blocks | Fused, sample: int | None = None) -> Kernel:
    """The fastest exact kernel for `stored` here: the row kernels where they run and take every
    part's type and shape, else its values in float32. Checked before it is returned: its
    products with unit vectors (every input column, or `sample` of them evenly spaced) are the
    blocks' values, bit for bit (torch.equal), so a kernel multiplies by exactly the file's values."""
    parts = stored.parts if isinstance(stored, Fused) else (stored,)
    if rows.available() and all(p.qtype in ROW_CODES and rows.fits(*p.codes.shape) for p in parts):
        kernel: Kernel = RowsBlocksKernel(parts)
    else:
        kernel = DequantizedKernel(stored)
    width = parts[0].codes.shape[1]
    values = stored.dequantize() if sample is None else None
    columns = torch.arange(width) if sample is None else torch.linspace(0, width - 1, sample).long()
    for chunk in columns.split(CHECK_COLUMNS):
        expected = stored.columns(chunk) if values is None else values[:, chunk[0]: chunk[-1] + 1]
        if not torch.equal(kernel_weights(kernel, chunk, width), expected):
            raise VerispecError(f"the kernel {kernel.name} does not multiply by its blocks' values "
                                f"exactly ({sum(p.codes.shape[0] for p in parts)} x {width})")
    return kernel


def kernel_weights(kernel: Kernel, columns: torch.Tensor, width: int) -> torch.Tensor:
    """The weights `kernel` multiplies by in the input columns `columns` [m]: its products with
    those unit vectors, [out, m] float32."""
    unit = torch.zeros(columns.shape[0], width)
    unit[torch.arange(columns.shape[0]), columns] = 1
    return kernel(unit).T.float()


# ---- the target --------------------------------------------------------------------------------


def stored_weight(tensor: TensorInfo, weight: torch.Tensor, heads: int) -> Blocks | None:
    """The blocks of GGUF `tensor` in the row order of the loaded `weight` [out, in] (as stored,
    or llama.cpp's interleaved rotary halves of q / k undone, as transformers loads Llama files),
    checked: equal to gguf-py's dequantization and to `weight`, bit for bit. None for a float
    tensor (its loaded weight is its value)."""
    if tensor.qtype in FLOAT_TYPES:
        return None
    if tensor.qtype not in QTYPES:
        raise VerispecError(f"GGUF tensor {tensor.name} is {tensor.qtype}, which verispec does not "
                            f"run as stored (types: {', '.join(QTYPES)}); use --dtype float32")
    columns, rows = tensor.shape[:2]
    blocks = read_blocks(tensor.data, tensor.qtype, rows, columns)
    values = blocks.dequantize()
    expected = dequantize(tensor.data, GGMLQuantizationType[tensor.qtype]).reshape(rows, columns)
    if not torch.equal(values, torch.from_numpy(expected)):
        raise VerispecError(f"GGUF tensor {tensor.name} ({tensor.qtype}): its blocks read back "
                            "differently from gguf-py's dequantization")
    loaded = weight.detach().float()
    if torch.equal(values, loaded):
        return blocks
    if rows % (2 * heads) == 0:
        order = llama_q_k_rows(rows, heads)
        if torch.equal(values[order], loaded):
            return blocks.rows(order)
    raise VerispecError(f"GGUF tensor {tensor.name} ({tensor.qtype}) is not the weight the model "
                        f"loaded ({tuple(weight.shape)})")


def gguf_target(model: nn.Module, path: Path) -> str:
    """Turn `model` (loaded from the GGUF file `path`, float32) into the file's own model in
    place: every linear layer and the LM head a QuantLinear over the file's blocks through its
    type's exact kernel, checked at load (the blocks equal gguf-py's dequantization and the loaded
    weights; the kernel's products with unit vectors give those weights back). Returns what ran,
    per type, for reports."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None or next(model.parameters()).device.type != "cpu":
        raise VerispecError("--dtype gguf runs a decoder (model.layers) on CPU")
    if next(model.parameters()).dtype != torch.float32:
        raise VerispecError("--dtype gguf starts from the float32 weights")
    _, tensors = gguf_tensors(path)
    config = model.config.get_text_config(decoder=True)
    heads = int(config.num_attention_heads)
    kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
    replaced: list[tuple[nn.Module, str, QuantLinear]] = []
    for index, layer in enumerate(layers):
        for short, name in GGUF_LINEARS.items():
            module = layer.get_submodule(name)
            tensor = tensors.get(f"blk.{index}.{short}.weight")
            if tensor is None:
                raise VerispecError(f"{path.name} has no tensor blk.{index}.{short}.weight")
            stored = stored_weight(tensor, module.weight, kv_heads if short == "attn_k" else heads)
            if stored is not None:
                parent, _, child = name.rpartition(".")
                replaced.append((layer.get_submodule(parent), child, _checked(stored, module, tensor.name)))
    head = model.get_output_embeddings()
    tensor = tensors.get("output.weight") or tensors.get("token_embd.weight")
    stored = stored_weight(tensor, head.weight, heads) if tensor is not None else None
    for parent, child, quantized in replaced:  # every check passed: nothing is half-converted
        setattr(parent, child, quantized)
    if stored is not None:
        model.set_output_embeddings(_checked(stored, head, tensor.name, sample=32))
        model.config.tie_word_embeddings = False  # the head no longer shares the embedding's tensor
    return "; ".join(dict.fromkeys(m.kernel.name for m in model.modules() if isinstance(m, QuantLinear)))


def _checked(stored: Blocks, module: nn.Linear, name: str, sample: int | None = None) -> QuantLinear:
    """A QuantLinear over `stored` through its exact kernel, checked (exact_kernel: every input
    column, or `sample` of them, evenly spaced, for the head)."""
    build = exact_kernel if sample is None else functools.partial(exact_kernel, sample=sample)
    try:
        return QuantLinear(stored, build, None if module.bias is None else module.bias.detach())
    except VerispecError as error:
        raise VerispecError(f"{name} ({stored.qtype}): {error}") from error


def stored_types(model: nn.Module) -> dict[str, int]:
    """How many of the model's linear layers run in each GGUF type."""
    found: dict[str, int] = {}
    for module in model.modules():
        if isinstance(module, QuantLinear) and isinstance(module.stored, Blocks):
            found[module.stored.qtype] = found.get(module.stored.qtype, 0) + 1
    return found


def own_int4(module: nn.Module) -> Int4Groups | None:
    """A quantized layer's own 4-bit groups: a 4-bit target's codes, or a GGUF tensor stored in
    4 bits (Q4_0, Q4_1, Q4_K) as the same values, for a drafter that takes the target's own
    codes; None for anything else."""
    stored = getattr(module, "stored", None)
    if isinstance(stored, Int4Groups):
        return stored
    return stored.int4() if isinstance(stored, Blocks) else None
