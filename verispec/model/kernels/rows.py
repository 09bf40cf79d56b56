"""Row-invariant products and attention over the C++ row kernels (rows.cpp, built by build.py).

A verification block of 2..17 rows should cost about one forward: torch's int4 kernel is a
matrix-vector kernel (8 rows cost 3x one row there), and oneDNN's bfloat16 products and SDPA's
per-row calls add their own per-row costs. These kernels read each weight tile once, unpack it
once and apply it to every row, with each row's arithmetic the same instructions whatever rows
came with it, so a position's result is the same bits in a one-token step, a block, a tree or a
batch (docs/invariance.md, docs/kernels.md).

Weights (made once at load, from the values a weight stands for; `features` on the C++ side
says whether this CPU runs them):
- `CodesProduct`: w = code * scale + min over groups of 16 or 32 inputs, codes of up to 8 bits
  (4-bit codes stored two to a byte, wider codes one to a byte), scales and minimums float32.
- `DenseProduct`: bfloat16 weights.
"""

from __future__ import annotations

import torch

from verispec.model.kernels.build import library, load

TILE = 16  # output columns per 512-bit lane set
GROUPS = (16, 32)
HEAD_DIMS = (16, 32, 64, 80, 96, 128, 256)  # what `attention` takes
NAME = "verispec rows, AVX512-BF16"  # how stats name these kernels


def available() -> bool:
    """Whether the row kernels run on this machine (built, and the CPU has AVX512-BF16)."""
    return library() is not None


def unavailable_reason() -> str:
    """Why the row kernels do not run here ("" where they do)."""
    return load()[1]


def fits(out_features: int, in_features: int) -> bool:
    """Whether a weight of this shape can be packed for the row kernels."""
    return out_features % TILE == 0 and in_features % 32 == 0


def pack_codes(codes: torch.Tensor, group: int, nibbles: bool) -> torch.Tensor:
    """codes [out, in] (uint8 0..15 if `nibbles`, else int8) -> the kernel's tile layout (rows.cpp):
    per 16 outputs and group, pair registers of (input 2p, 2p + 1) for each output."""
    out_features, in_features = codes.shape
    tiles, groups = out_features // TILE, in_features // group
    if nibbles:
        c = codes.to(torch.uint8).reshape(tiles, TILE, groups, group // 4, 2, 2)  # [t, j, g, q, h, e]
        c = c.permute(0, 2, 3, 1, 5, 4)  # [t, g, q, j, e, h]
        return (c[..., 0] | (c[..., 1] << 4)).contiguous().reshape(-1)
    c = codes.to(torch.int8).reshape(tiles, TILE, groups, group // 2, 2)  # [t, j, g, p, e]
    return c.permute(0, 2, 3, 1, 4).contiguous().reshape(-1)


def pack_groups(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Per-group scales or minimums [out, groups] -> [tiles, groups, 16] in `dtype`."""
    out_features, groups = values.shape
    return values.to(dtype).reshape(out_features // TILE, TILE, groups).transpose(1, 2).contiguous()


class CodesProduct:
    """x [..., in] (float32 or bfloat16) -> x @ w.T [..., out] float32, w = code * scale + min
    per group of `group` inputs (mins None: w = code * scale). Groups wider than 32 run as groups
    of 32 (the same weights). Scales and minimums are stored in float16 where that holds them
    exactly (a GGUF block's own), else float32."""

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None,
                 bits: int = 4) -> None:
        # codes: [out, in] integers (0..15 for 4 bits, else -128..127); scales, mins: [out, in // group]
        self.out_features, self.in_features = codes.shape
        group = self.in_features // scales.shape[1]
        if group > 32:
            repeat = group // 32
            scales, group = scales.repeat_interleave(repeat, 1), 32
            mins = None if mins is None else mins.repeat_interleave(repeat, 1)
        if group not in GROUPS or not fits(self.out_features, self.in_features):
            raise ValueError(f"row kernels take groups of 16 or 32 over in % 32 == 0, out % 16 == 0 "
                             f"(got group {group}, shape {tuple(codes.shape)})")
        self.group, self.nibbles = group, bits <= 4
        self.codes = pack_codes(codes, group, self.nibbles)
        exact = [t.float() for t in (scales, mins) if t is not None]
        half = all(torch.equal(t.half().float(), t) for t in exact)
        dtype = torch.float16 if half else torch.float32
        self.scales = pack_groups(scales, dtype)
        self.mins = None if mins is None else pack_groups(mins, dtype)
        self.nbytes = sum(t.numel() * t.element_size() for t in (self.codes, self.scales, self.mins)
                          if t is not None)
        self.name = (f"{bits}-bit codes g{group}, {'float16' if half else 'float32'} scales "
                     f"({NAME}, bfloat16 activations)")

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features).contiguous()
        out = library().linear_codes(flat, self.codes, self.scales, self.mins, self.group, self.nibbles,
                                     self.out_features)
        return out.reshape(*x.shape[:-1], self.out_features)


class DenseProduct:
    """x [..., in] -> x @ w.T [..., out] in x's dtype (float32 or bfloat16), w bfloat16."""

    def __init__(self, weight: torch.Tensor) -> None:
        # weight: [out, in]
        self.out_features, self.in_features = weight.shape
        if not fits(self.out_features, self.in_features):
            raise ValueError(f"row kernels take in % 32 == 0 and out % 16 == 0 (got {tuple(weight.shape)})")
        w = weight.detach().to(torch.bfloat16).reshape(self.out_features // TILE, TILE,
                                                       self.in_features // 32, 16, 2)
        self.packed = w.permute(0, 2, 3, 1, 4).contiguous().reshape(-1)  # [t, c, p, j, e]
        self.nbytes = self.packed.numel() * 2
        self.name = f"bfloat16 ({NAME})"

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features).contiguous()
        out = library().linear_dense(flat, self.packed, self.out_features, x.dtype == torch.bfloat16)
        return out.reshape(*x.shape[:-1], self.out_features)


def attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, length: int,
              mask: torch.Tensor | None, scale: float) -> torch.Tensor:
    """Each query row over exactly the keys it sees, in cache order, in float32: a causal row i
    (mask None) over the first length - n + i + 1 keys, a tree row over its mask's keys.
    q: [1, heads, n, head_dim]; keys, values: a cache's whole buffers [1, kv_heads, capacity,
    head_dim] (KVCache), the first `length` slots valid; mask: [n, length] bool. Returns
    [1, n, heads * head_dim] in q's dtype."""
    return library().attention(q[0], keys[0], values[0], mask, length, scale)[None]
