"""Row-invariant products and attention over the C++ row kernels (rows.cpp, built by build.py).

A verification block of 2..17 rows should cost about one forward: torch's int4 kernel is a
matrix-vector kernel (8 rows cost 3x one row there), and oneDNN's bfloat16 products and SDPA's
per-row calls add their own per-row costs. These kernels read each weight tile once, unpack it
once and apply it to every row, with each row's arithmetic the same instructions whatever rows
came with it, so a position's result is the same bits in a one-token step, a block, a tree or a
batch (docs/invariance.md, docs/kernels.md).

Kernel classes (`CLASSES`): AVX512-BF16 (vdpbf16ps) and AVX2/FMA (every x86 CPU since 2013), the
same bits by construction (rows.cpp's AVX2 section). A process runs one class, `choice()`: forced
by VERISPEC_KERNELS=<class>|off, else the fastest of those this CPU runs that keeps rows
invariant, by a probe of a few milliseconds on the first use, cached per CPU and torch version in
the user's cache directory.

Weights (made once at load, from the values a weight stands for; the same layout for every
class):
- `CodesProduct`: w = code * scale + min over groups of 16 or 32 inputs, codes of up to 8 bits
  (4-bit codes stored two to a byte, wider codes one to a byte), scales and minimums float32.
- `DenseProduct`: bfloat16 weights.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import platform
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch.nn import functional as F

from verispec.core.errors import VerispecError
from verispec.core.files import write_json
from verispec.model.kernels.build import cache_dir, emulated, library, library_name, load

TILE = 16  # output columns per 512-bit lane set
GROUPS = (16, 32)
HEAD_DIMS = (16, 32, 64, 80, 96, 128, 256)  # what `attention` takes
# Kernel classes: (rows.cpp's Isa, the CPU feature it needs as `features()` names it, label).
# onednn-fixed16: torch's bfloat16 F.linear (oneDNN; AMX where the CPU has it) always called at
# [16, in], rows padded, weights dequantized to bfloat16 (a 4-bit target's arithmetic changes), row
# attention as AVX512-BF16's; probed only on a CPU with AMX, forceable on any with AVX512-BF16.
CLASSES = {"amx-bf16": (2, "amx_bf16", "AMX-BF16"),
           "onednn-fixed16": (1, "avx512_bf16", "oneDNN bfloat16 at 16 rows"),
           "avx512-bf16": (1, "avx512_bf16", "AVX512-BF16"), "avx2": (0, "avx2", "AVX2/FMA")}
ONEDNN = "onednn-fixed16"
AMX = "amx-bf16"
FIXED_ROWS = 16  # the oneDNN class's one shape: every call multiplies [16, in]
# Classes that compute the same bits (rows.cpp: AVX2 spells vdpbf16ps); AMX's tiles have their own.
SAME_BITS = ("avx512-bf16", "avx2")
# The probe's products: a SmolLM2 layer's fused q/k/v, o, gate/up and down [out, in], 4-bit g32.
PROBE_SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536))
PROBE_ROWS = (1, 8)


@dataclass(frozen=True)
class Choice:
    """The kernel class a process runs (None: none runs here) and why."""

    name: str | None
    why: str


def supported() -> list[str]:
    """The kernel classes this CPU runs (none where the library does not load)."""
    found = library()
    if found is None:
        return []
    features = set(found.features())
    return [name for name, (_, needs, _) in CLASSES.items() if needs in features]


def instruction_limits() -> dict[str, str]:
    """The instruction sets torch and oneDNN are held to (ATEN_CPU_CAPABILITY,
    ONEDNN_MAX_CPU_ISA): the same CPU held to AVX2 is another machine for costs and kernels."""
    return {"torch_isa": torch.backends.cpu.get_cpu_capability(),
            "onednn_isa": os.environ.get("ONEDNN_MAX_CPU_ISA", os.environ.get("DNNL_MAX_CPU_ISA", ""))}


def cpu_key() -> str:
    """This CPU's model and flags, the instruction sets torch and oneDNN are held to, torch's
    version and the kernels' build: what a choice depends on."""
    model, flags = platform.processor(), ""
    try:
        for line in open("/proc/cpuinfo", encoding="utf-8"):
            if line.startswith("model name") and not model.strip():
                model = line.split(":", 1)[1].strip()
            elif line.startswith("flags"):
                flags = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    held = "|".join(instruction_limits().values())
    text = f"{model}|{flags}|{held}|{torch.__version__}|{library_name()}"
    return hashlib.sha1(text.encode()).hexdigest()[:16]


def probe(names: list[str]) -> dict[str, float | None]:
    """Per class, seconds for the probe's products at 1 and 8 rows (best of 3, one thread: a
    class's own speed, which a busy machine's thread scheduling would drown), or None where a
    row's bits differ alone and among 8 (torch.equal): that class may not run."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _probe(names)
    finally:
        torch.set_num_threads(threads)


def _probe(names: list[str]) -> dict[str, float | None]:
    generator = torch.Generator().manual_seed(0)
    shapes = [(torch.randint(0, 16, shape, dtype=torch.uint8, generator=generator),
               torch.rand(shape[0], shape[1] // 32, generator=generator) / 16,
               -torch.rand(shape[0], shape[1] // 32, generator=generator) / 2) for shape in PROBE_SHAPES]
    inputs = {rows: [torch.randn(rows, shape[1], generator=generator) for shape in PROBE_SHAPES]
              for rows in PROBE_ROWS}
    seconds: dict[str, float | None] = {}
    for name in names:
        products = [CodesProduct(codes, scales, mins, kernel=name) for codes, scales, mins in shapes]
        block = inputs[max(PROBE_ROWS)]
        if not all(torch.equal(product(x[i: i + 1]), out[i: i + 1])
                   for product, x in zip(products, block) for out in [product(x)] for i in range(len(x))):
            seconds[name] = None
            continue
        best = float("inf")
        for _ in range(3):
            started = time.perf_counter()
            for rows in PROBE_ROWS:
                for product, x in zip(products, inputs[rows]):
                    product(x)
            best = min(best, time.perf_counter() - started)
        seconds[name] = best
    return seconds


def choose(names: list[str]) -> Choice:
    """The fastest of `names` by `probe` that keeps rows invariant, and the measurements why."""
    seconds = probe(names)
    passing = {name: s for name, s in seconds.items() if s is not None}
    listed = ", ".join(f"{name} {s * 1e3:.2f} ms" if s is not None else f"{name} not row-invariant"
                       for name, s in seconds.items())
    if not passing:
        return Choice(None, f"no kernel class kept rows invariant here ({listed})")
    best = min(passing, key=passing.__getitem__)
    return Choice(best, f"fastest of {{{listed}}} (products at {' and '.join(map(str, PROBE_ROWS))} rows)")


@functools.cache
def choice() -> Choice:
    """The kernel class this process runs: VERISPEC_KERNELS=<class>|off forces; else the class
    cached for this CPU, torch and build; else `choose` among those this CPU runs, cached."""
    forced = os.environ.get("VERISPEC_KERNELS", "").strip().lower()
    if forced in ("off", "0", "no"):
        return Choice(None, "turned off (VERISPEC_KERNELS=off)")
    if forced and forced not in CLASSES:
        raise VerispecError(f"VERISPEC_KERNELS={forced!r}: expected one of {', '.join(CLASSES)} or off")
    found, why = load()
    if found is None:
        return Choice(None, why)
    names = supported()
    if forced:
        label = CLASSES[forced][2]
        return (Choice(forced, f"forced (VERISPEC_KERNELS={forced})") if forced in names
                else Choice(None, f"this CPU lacks {label} (VERISPEC_KERNELS={forced})"))
    if emulated() and AMX in names:
        names.remove(AMX)  # the tests' emulation of the tiles runs only where forced
    if ONEDNN in names and AMX not in names:
        names.remove(ONEDNN)  # oneDNN without AMX: the row kernels' own arithmetic, slower
    if not names:
        return Choice(None, "this CPU lacks AVX2 and AVX512-BF16")
    cached = cache_dir() / f"choice-{cpu_key()}.json"
    try:
        stored = json.loads(cached.read_text())
        if stored["name"] in names:
            return Choice(stored["name"], stored["why"] + " (cached)")
    except (OSError, ValueError, KeyError, TypeError):
        pass
    chosen = choose(names) if len(names) > 1 else Choice(names[0], "the only class this CPU runs")
    if chosen.name is not None:
        try:
            cached.parent.mkdir(parents=True, exist_ok=True)
            write_json(cached, {"name": chosen.name, "why": chosen.why}, indent=None)
        except OSError:
            pass
    return chosen


def available() -> bool:
    """Whether the row kernels run on this machine (built, a class this CPU runs)."""
    return choice().name is not None


def unavailable_reason() -> str:
    """Why the row kernels do not run here ("" where they do)."""
    return "" if available() else choice().why


def name(kernel: str | None = None) -> str:
    """How stats name a kernel class (default: this process's)."""
    chosen = kernel or choice().name
    return f"verispec rows, {CLASSES[chosen][2]}" + (" (emulated)" if chosen == AMX and emulated() else "")


def fixed_shape_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [M, in] -> x @ weight.T [M, out] bfloat16 through oneDNN (F.linear), always at
    [FIXED_ROWS, in]: the rows in chunks of 16, the last padded with zeros, so a row's bits cannot
    depend on the row count (the probe and tests/test_row_kernels.py check its slot does not
    either). weight: [out, in] bfloat16."""
    xb = x.to(torch.bfloat16)
    pad = -xb.shape[0] % FIXED_ROWS
    if pad:
        xb = torch.cat([xb, xb.new_zeros(pad, xb.shape[1])])
    return torch.cat([F.linear(chunk, weight) for chunk in xb.split(FIXED_ROWS)])[: x.shape[0]]


def isa(kernel: str | None) -> int:
    """rows.cpp's number for a class (None: this process's)."""
    chosen = kernel or choice().name
    if chosen is None:
        raise VerispecError(f"the row kernels do not run here: {unavailable_reason()}")
    return CLASSES[chosen][0]


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
    exactly (a GGUF block's own), else float32. `kernel`: a class of CLASSES (default: this
    process's `choice()`)."""

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor | None,
                 bits: int = 4, kernel: str | None = None) -> None:
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
        self.kernel, self.isa = kernel or choice().name, isa(kernel)
        self.name = (f"{bits}-bit codes g{group}, {'float16' if half else 'float32'} scales "
                     f"({name(self.kernel)}, bfloat16 activations)")
        self.dense = None  # [out, in] bfloat16: the weights as the oneDNN class multiplies them
        if self.kernel == ONEDNN:
            grouped = codes.float().reshape(self.out_features, -1, group) * scales.float()[..., None]
            if mins is not None:
                grouped = grouped + mins.float()[..., None]
            self.dense = grouped.reshape(self.out_features, self.in_features).to(torch.bfloat16)
            self.name = f"{bits}-bit codes g{group} as bfloat16 weights ({name(self.kernel)})"

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.dense is not None:
            flat = x.reshape(-1, self.in_features).contiguous()
            return fixed_shape_linear(flat, self.dense).float().reshape(*x.shape[:-1], self.out_features)
        return library().linear_codes(x, self.codes, self.scales, self.mins, self.group, self.nibbles,
                                      self.out_features, self.isa)  # x [..., in] -> [..., out]


class DenseProduct:
    """x [..., in] -> x @ w.T [..., out] in x's dtype (float32 or bfloat16), w bfloat16; `kernel`
    as CodesProduct's."""

    def __init__(self, weight: torch.Tensor, kernel: str | None = None) -> None:
        # weight: [out, in]
        self.out_features, self.in_features = weight.shape
        if not fits(self.out_features, self.in_features):
            raise ValueError(f"row kernels take in % 32 == 0 and out % 16 == 0 (got {tuple(weight.shape)})")
        w = weight.detach().to(torch.bfloat16).reshape(self.out_features // TILE, TILE,
                                                       self.in_features // 32, 16, 2)
        self.packed = w.permute(0, 2, 3, 1, 4).contiguous().reshape(-1)  # [t, c, p, j, e]
        self.nbytes = self.packed.numel() * 2
        self.kernel, self.isa = kernel or choice().name, isa(kernel)
        self.name = f"bfloat16 ({name(self.kernel)})"
        self.dense = weight.detach().to(torch.bfloat16).contiguous() if self.kernel == ONEDNN else None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.dense is not None:
            out = fixed_shape_linear(x.reshape(-1, self.in_features).contiguous(), self.dense).to(x.dtype)
            return out.reshape(*x.shape[:-1], self.out_features)
        bf16_out = x.dtype == torch.bfloat16
        return library().linear_dense(x, self.packed, self.out_features, bf16_out, self.isa)  # [..., out]


def attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, length: int,
              mask: torch.Tensor | None, scale: float, kernel: str | None = None,
              window: int | None = None) -> torch.Tensor:
    """Each query row over exactly the keys it sees, in cache order, in float32 (the scores of
    a bfloat16 cache on the AMX class: attention_arithmetic): a causal row i (mask None) over the
    first length - n + i + 1 keys (with a sliding `window`, the last `window` of them), a tree row
    over its mask's keys (a window already applied to it). q: [1, heads, n, head_dim]; keys,
    values: a cache's whole buffers [1, kv_heads, capacity, head_dim] (KVCache), the first
    `length` slots valid; mask: [n, length] bool. Returns [1, n, heads * head_dim] in q's dtype;
    `kernel` as CodesProduct's."""
    return library().attention(q, keys, values, mask, length, scale, isa(kernel), window or 0)


def attention_arithmetic(dtype: torch.dtype, head_dim: int, kernel: str | None = None) -> str:
    """How `attention` computes over a cache of `dtype`, for stats: float32 throughout, but for
    a bfloat16 cache on the AMX class with heads a multiple of 32 wide, whose scores come from AMX
    tiles (rows.cpp's attention_tiles; the softmax and the values in float32 as elsewhere)."""
    if (kernel or choice().name) == AMX and dtype == torch.bfloat16 and head_dim % 32 == 0:
        return "AMX tiles' scores, float32 softmax and values"
    return "float32"


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Each row of x [..., H] RMS-normalised and scaled by weight [H] (x's dtype, float32 or
    bfloat16), row-invariant and the same bits on every x86-64 CPU (rows.cpp); x's shape."""
    return library().rms_norm(x, weight, eps)


def module_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, gemma: bool) -> torch.Tensor:
    """A Hugging Face RMSNorm module's forward by its own ops in one call (its bits; rows.cpp):
    x [..., H]; weight [H] the module's (Llama's order) or, gemma, 1 + it in float32 (Gemma 3's)."""
    return library().module_norm(x, weight, eps, gemma)


def rotate(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """lean.rotate in one call, the same bits: x [1, n, heads, head_dim] (last dimension
    contiguous), cos and signed_sin [n, 1, head_dim] in x's dtype -> [1, n, heads, head_dim]."""
    return library().rotate(x, cos, signed_sin)


def heads_into_cache(qkv: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor, keys: torch.Tensor,
                     values: torch.Tensor, start: int, heads: int) -> torch.Tensor:
    """A block's qkv product [1, n, (heads + 2 kv_heads) * head_dim] -> its queries rotated
    [1, heads, n, head_dim]; its keys rotated and its values written into a cache's buffers
    [1, kv_heads, capacity, head_dim] at slots start .. start + n - 1 (claimed first:
    KVCache.claim). The bits of `rotate` and of the copies it replaces."""
    return library().heads_into_cache(qkv, cos, signed_sin, keys, values, start, heads)


def native_parts(products: list[CodesProduct | DenseProduct]) -> list[object] | None:
    """A product (its parts' outputs concatenated) as rows.cpp's layer loop takes it; None where
    a part is of the oneDNN class, which the loop does not run."""
    if any(product.kernel == ONEDNN for product in products):
        return None
    return [library().Part(product.codes, product.scales, product.mins, product.group, product.out_features,
                           product.isa, product.nibbles, False) if isinstance(product, CodesProduct)
            else library().Part(product.packed, product.packed.new_empty(0), None, 0, product.out_features,
                                product.isa, False, True)
            for product in products]


def native_onednn(packed: torch.Tensor, bias: torch.Tensor | None) -> list[object]:
    """A oneDNN-prepacked float product (packed.pack_weight's tensor, its bias or None) as
    rows.cpp's layer loop takes it: torch's own op, called from there."""
    return [library().Part(packed, None if bias is None else bias.detach())]


def native_layer(attn_norm: torch.Tensor, mlp_norm: torch.Tensor, qkv: object, out: object,
                 gate_up: object, down: object, q_norm: torch.Tensor | None = None,
                 k_norm: torch.Tensor | None = None, attn_post_norm: torch.Tensor | None = None,
                 mlp_post_norm: torch.Tensor | None = None, window: int | None = None, kind: int = 0,
                 sight: int = 0) -> object:
    """A decoder layer for rows.cpp's layer loop: its RMSNorm scales [hidden] (the activations'
    dtype) and its products (native_parts); where the family has them, its per-head q and k norm
    scales [head_dim] and its sandwich norms' [hidden] (None: none), its sliding window, and the
    indices of the rotary table (`kind`) and mask (`sight`) it reads among those `run` takes."""
    return library().Layer(attn_norm, mlp_norm, qkv, out, gate_up, down, q_norm, k_norm, attn_post_norm,
                           mlp_post_norm, window or 0, kind, sight)


def native_stack(layers: list[object], eps: float, scale: float, heads: int, kernel: str,
                 module_norms: bool, least: Sequence[int] = (1, 1, 1, 1), gemma_norms: bool = False,
                 gelu: bool = False) -> object:
    """rows.cpp's layer loop over `layers` (native_layer): `run(x, keys, values, cos, signed_sin,
    start, masks, capture, attn_input)` is lean.forward_rows' layer loop for one block in one call,
    the same bits (cos, signed_sin and masks: one per kind and sight its layers read; its
    attention in `kernel`'s class; its norms `rms_norm`, or with `module_norms` Hugging Face's
    RMSNorm module's ops, Gemma 3's with `gemma_norms`; the MLP gated by SiLU, or with `gelu` by
    GELU's tanh form; the q/k/v, o, gate/up and down products over at least `least` rows each,
    zero rows padding fewer, as an invariant pass multiplies them); attn_input (or None) is what
    the first layer's q/k/v product reads instead of the norm of x (an EAGLE-3 drafter's layer)."""
    return library().Stack(layers, eps, scale, heads, isa(kernel), module_norms, gemma_norms, gelu,
                           list(least))
