"""The row kernels (verispec/model/kernels): each row's result is the same bits whatever rows
came with it (blocks of 1..17 rows at any offset, torch.equal), and the values are the products
and attention they stand for. The check is shown to catch a product whose rounding depends on
the row count, so a passing run means something. The lean targets' own invariance (blocks 2..17,
trees, batches) is tests/test_invariance.py, which runs on these kernels where they run; a test
here checks that they do. Skipped, with the reason, where the kernels do not run (a CPU without
AVX512-BF16, no compiler)."""

from __future__ import annotations

import functools
import importlib
import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch.nn import functional as F

from tests.test_invariance import assert_the_cpp_loop_gives_the_python_loops_bits
from tests.tiny import tiny_llama
from verispec.model.cached_model import CachedModel
from verispec.model.gguf_blocks import RowsBlocksKernel
from verispec.model.kernels import build, rows
from verispec.model.lean import MODULE_NORMS, LeanDecoder, LeanWeights, ModuleNorm, module_norm, rotate
from verispec.model.loading import DEFAULT_MODEL, load_model
from verispec.model.lowbit import Int4Groups, Int8Groups, RowsInt4Kernel, RowsInt8Kernel, int4_target

pytestmark = pytest.mark.skipif(not rows.available(), reason=f"row kernels: {rows.unavailable_reason()}")

ROWS = 17
KERNELS = [pytest.param(kernel, id=kernel, marks=pytest.mark.skipif(
    kernel not in rows.supported(), reason=f"needs {label} ({kernel}): this CPU lacks it"))
    for kernel, (_, _, label) in rows.CLASSES.items()]


def rows_differing(product: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> list[tuple[int, int]]:
    """(start, count) of every block x[start: start + count] (count 1..17) whose rows do not
    give the bits those rows give among all 17. x: [17, in]."""
    whole = product(x)
    return [(start, count) for count in range(1, ROWS + 1) for start in range(ROWS - count + 1)
            if not torch.equal(product(x[start: start + count]), whole[start: start + count])]


def weight(out_features: int = 96, in_features: int = 128, seed: int = 0) -> torch.Tensor:
    return torch.randn(out_features, in_features, generator=torch.Generator().manual_seed(seed))


def activations(in_features: int = 128, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(ROWS, in_features, generator=torch.Generator().manual_seed(1)).to(dtype)


def int8_groups(w: torch.Tensor) -> Int8Groups:
    """w rounded to a Q8_0 grid (groups of 32, float16 scales, codes -127..127), as its blocks."""
    grouped = w.reshape(w.shape[0], -1, 32)
    scales = (grouped.abs().amax(-1, keepdim=True) / 127).half().float()
    on_grid = ((grouped / scales).round().clamp(-127, 127) * scales).reshape(w.shape)
    found = Int8Groups.exact(on_grid)
    assert found is not None
    return found


def products(kernel: str) -> dict[str, tuple[Callable[[torch.Tensor], torch.Tensor], torch.Tensor]]:
    """Each kind of product the kernels run on one class, with the weights [out, in] it stands for."""

    def codes(q: Int4Groups) -> rows.CodesProduct:
        return rows.CodesProduct(q.codes, q.scales, q.mins, kernel=kernel)

    w = weight()
    g32, g16, g64 = (Int4Groups.quantize(w, group) for group in (32, 16, 64))
    half = Int4Groups(g32.codes, g32.scales.half().float(), g32.mins.half().float())  # a GGUF's own
    q8 = int8_groups(w)
    return {
        "int4 g32 float32 scales": (codes(g32), g32.dequantize()),
        "int4 g32 float16 scales": (codes(half), half.dequantize()),
        "int4 g16": (codes(g16), g16.dequantize()),
        "int4 g64 (as g32)": (codes(g64), g64.dequantize()),
        "int8 g32 no minimums": (rows.CodesProduct(q8.codes, q8.scales, None, bits=8, kernel=kernel),
                                 q8.dequantize()),
        "bfloat16 dense": (rows.DenseProduct(w, kernel=kernel), w.to(torch.bfloat16).float()),
    }


KINDS = list(products(rows.choice().name)) if rows.available() else []


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_products_give_each_row_its_own_bits(kernel, kind, dtype):
    product, _ = products(kernel)[kind]
    assert rows_differing(product, activations(dtype=dtype)) == []


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("kind", KINDS)
def test_products_compute_the_weights_they_stand_for(kernel, kind):
    product, dense = products(kernel)[kind]
    x = activations()
    expected = x.to(torch.bfloat16).double() @ dense.double().T  # activations rounded to bfloat16
    got = product(x)
    assert got.shape == (ROWS, dense.shape[0])
    # the oneDNN class multiplies bfloat16 weights into bfloat16 sums: their rounding
    tolerance = 1e-2 if kernel == rows.ONEDNN else 1e-5
    assert (got.double() - expected).abs().max() <= tolerance * expected.abs().max()


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("group", [32, 16])
def test_products_take_every_count_of_output_tiles(kernel, group):
    """1..7 tiles of 16 outputs cut between 1, 2 or 3 threads: a thread's run of tiles is any
    length, so every way the kernels step through it (the AMX class three tiles at a time, then
    two or one) runs; each output is the weights' product, with the same bits however cut."""
    threads = torch.get_num_threads()
    x = activations()
    try:
        for tiles in range(1, 8):
            q = Int4Groups.quantize(weight(16 * tiles), group)
            product = rows.CodesProduct(q.codes, q.scales, q.mins, kernel=kernel)
            expected = x.to(torch.bfloat16).double() @ q.dequantize().double().T
            torch.set_num_threads(1)
            alone = product(x)
            tolerance = 1e-2 if kernel == rows.ONEDNN else 1e-5  # oneDNN's bfloat16 sums
            assert (alone.double() - expected).abs().max() <= tolerance * expected.abs().max(), tiles
            for count in (2, 3):
                torch.set_num_threads(count)
                assert torch.equal(product(x), alone), (tiles, count)
    finally:
        torch.set_num_threads(threads)


def test_the_check_catches_a_product_that_rounds_by_row_count():
    """A product that sums a lone row in another order than a block (as float32 F.linear did,
    docs/invariance.md) is caught: the test above would see a kernel that did so."""
    w = weight()

    def by_count(x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] == 1:
            return (x.double() @ w.double().T).float()
        return x @ w.T

    assert {(start, 1) for start in range(ROWS)} <= set(rows_differing(by_count, activations()))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("width", [576, 72])  # SmolLM2's hidden size; one with a tail past 16s
def test_the_norm_gives_each_row_its_own_bits_and_the_rms_norm(dtype, width):
    """rows.rms_norm: a row's bits the same in every block of 1..17 rows, and each row
    x / sqrt(mean(x^2) + eps) * weight as float64 computes it (the normalised value rounded to
    bfloat16 before the weight, for a bfloat16 x, as Llama's module does)."""
    generator = torch.Generator().manual_seed(3)
    x = (torch.randn(ROWS, width, generator=generator) * 3).to(dtype)
    scale = (1 + torch.randn(width, generator=generator) / 4).to(dtype)
    eps = 1e-5

    def norm(block: torch.Tensor) -> torch.Tensor:
        return rows.rms_norm(block, scale, eps)

    assert rows_differing(norm, x) == []
    got = norm(x[None])  # any leading dimensions
    assert got.shape == (1, ROWS, width) and got.dtype == dtype
    wide = x.double()
    normalised = wide / (wide.pow(2).mean(-1, keepdim=True) + eps).sqrt()
    if dtype == torch.bfloat16:
        normalised = normalised.to(torch.bfloat16).double()
    expected = normalised * scale.double()
    tolerance = 1e-6 if dtype == torch.float32 else 1e-2  # bfloat16: one rounding of the result
    assert (got[0].double() - expected).abs().max() <= tolerance * expected.abs().max()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", sorted(MODULE_NORMS))
def test_a_module_norm_gives_the_modules_own_bits(name, dtype):
    """lean.ModuleNorm (rows.module_norm): every RMSNorm class it stands in for gives the bits of
    the module itself (a float target's arithmetic is the model's own), over a one-token step, a
    block, and a per-head q/k norm's rows; weights and activations far from 1, so a changed order
    of the ops (the weight applied before the cast back, or Gemma's 1 + weight dropped) shows."""
    family = name.removesuffix("RMSNorm").lower()
    module_class = getattr(importlib.import_module(f"transformers.models.{family}.modeling_{family}"), name)
    generator = torch.Generator().manual_seed(5)
    for width in (576, 64):  # a hidden size; a head's
        module = module_class(width, eps=1e-6)
        with torch.no_grad():
            module.weight.copy_(torch.randn(width, generator=generator) / 3)
        module = module.to(dtype)
        norm = module_norm(module)
        assert isinstance(norm, ModuleNorm)
        for rows_count in (1, 3, 17):
            x = (torch.randn(1, rows_count, width, generator=generator) * 7).to(dtype)
            assert torch.equal(norm(x), module(x))
    assert module_norm(torch.nn.RMSNorm(8)).__class__ is torch.nn.RMSNorm  # a class it does not spell


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 256])  # SmolLM2's; Gemma 3's
def test_rotate_gives_the_bits_of_the_four_torch_ops(dtype, head_dim):
    """rows.rotate on a view of a qkv product's columns (heads strided within each row) gives
    lean.rotate's bits, and the lean forward on a CPU rotates with it."""
    generator = torch.Generator().manual_seed(4)
    n, heads = 5, 12
    qkv = torch.randn(1, n, (heads + 2) * head_dim, generator=generator).to(dtype)
    x = qkv[..., : heads * head_dim].view(1, n, heads, head_dim)  # rows strided by the qkv width
    angles = torch.randn(n, 1, head_dim, generator=generator)
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    half = head_dim // 2
    swap = torch.cat([torch.arange(half, head_dim), torch.arange(half)])
    got = rows.rotate(x, cos, sin)
    assert got.shape == x.shape and got.is_contiguous()
    assert torch.equal(got, rotate(x, cos, sin, swap))
    assert LeanWeights(tiny_llama()).rotate is rows.rotate


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_heads_into_cache_gives_the_queries_and_cache_of_the_ops_it_replaces(dtype):
    """rows.heads_into_cache: the queries rotated as `rotate` rotates them, in attention's layout;
    the keys rotated and the values written at slots length.. of the cache, every other slot as
    it was."""
    generator = torch.Generator().manual_seed(5)
    n, heads, kv_heads, head_dim, capacity, length = 4, 9, 3, 64, 16, 7
    qkv = torch.randn(1, n, (heads + 2 * kv_heads) * head_dim, generator=generator).to(dtype)
    angles = torch.randn(n, 1, head_dim, generator=generator)
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    keys, values = (torch.randn(1, kv_heads, capacity, head_dim, generator=generator).to(dtype)
                    for _ in range(2))
    before = keys.clone(), values.clone()
    q = rows.heads_into_cache(qkv, cos, sin, keys, values, length, heads)

    half = head_dim // 2
    swap = torch.cat([torch.arange(half, head_dim), torch.arange(half)])
    split = qkv.view(1, n, heads + 2 * kv_heads, head_dim)
    rotated = rotate(split[:, :, : heads + kv_heads], cos, sin, swap)  # [1, n, heads + kv, d]
    assert torch.equal(q, rotated[:, :, :heads].transpose(1, 2))
    new = slice(length, length + n)
    assert torch.equal(keys[:, :, new], rotated[:, :, heads:].transpose(1, 2))
    assert torch.equal(values[:, :, new], split[:, :, heads + kv_heads:].transpose(1, 2))
    for written, old in zip((keys, values), before):
        assert torch.equal(written[:, :, :length], old[:, :, :length])
        assert torch.equal(written[:, :, length + n:], old[:, :, length + n:])


def attention_inputs(dtype: torch.dtype, head_dim: int = 64):
    """q [1, 9, 5, head_dim], a cache's buffers [1, 3, 64, head_dim] with 40 valid slots."""
    generator = torch.Generator().manual_seed(2)
    q = torch.randn(1, 9, 5, head_dim, generator=generator).to(dtype)
    keys, values = (torch.randn(1, 3, 64, head_dim, generator=generator).to(dtype) for _ in range(2))
    return q, keys, values


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [16, 64, 128])
def test_attention_rows_match_one_query_each(kernel, dtype, head_dim):
    """A causal block's row i is the one-query call over the first 40 - 5 + i + 1 keys; a tree
    row over its mask's keys is the one-query call over those keys gathered in order."""
    q, keys, values = attention_inputs(dtype, head_dim)
    block = rows.attention(q, keys, values, 40, None, 0.125, kernel)
    for i in range(5):
        alone = rows.attention(q[:, :, i: i + 1], keys, values, 40 - 5 + i + 1, None, 0.125, kernel)
        assert torch.equal(block[:, i], alone[:, 0])
    mask = torch.ones(5, 40, dtype=torch.bool)
    mask[:, 35:] = torch.tensor([[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 0, 1, 0, 0], [1, 0, 1, 1, 0],
                                 [1, 1, 0, 0, 1]], dtype=torch.bool)
    tree = rows.attention(q, keys, values, 40, mask, 0.125, kernel)
    for i in range(5):
        seen = mask[i].nonzero()[:, 0]
        gathered = [t[:, :, seen].contiguous() for t in (keys, values)]
        alone = rows.attention(q[:, :, i: i + 1], *gathered, len(seen), None, 0.125, kernel)
        assert torch.equal(tree[:, i], alone[:, 0])
    reference = F.scaled_dot_product_attention(
        q.double(), keys[:, :, :40].double(), values[:, :, :40].double(), attn_mask=mask, scale=0.125,
        enable_gqa=True).transpose(1, 2).reshape(1, 5, -1)
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2  # bfloat16: the output's own rounding
    assert (tree.double() - reference).abs().max() < tolerance


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_sliding_window_sees_each_rows_last_keys(kernel, dtype):
    """With a window of 7, a causal block's row i is the one-query call over its own last 7 keys
    (slots 40 - 5 + i - 6 .. 40 - 5 + i), and the same bits as a mask naming those keys; without
    the window it sees all of them, and differs."""
    q, keys, values = attention_inputs(dtype, 64)
    block = rows.attention(q, keys, values, 40, None, 0.125, kernel, window=7)
    mask = torch.zeros(5, 40, dtype=torch.bool)
    for i in range(5):
        end = 40 - 5 + i + 1
        mask[i, end - 7: end] = True
        window = [t[:, :, end - 7: end].contiguous() for t in (keys, values)]
        alone = rows.attention(q[:, :, i: i + 1], *window, 7, None, 0.125, kernel)
        assert torch.equal(block[:, i], alone[:, 0])
        step = rows.attention(q[:, :, i: i + 1], keys, values, end, None, 0.125, kernel, window=7)
        assert torch.equal(block[:, i], step[:, 0])  # a one-token step at that position
    assert torch.equal(block, rows.attention(q, keys, values, 40, mask, 0.125, kernel))
    assert not torch.equal(block, rows.attention(q, keys, values, 40, None, 0.125, kernel))




@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("heads,kv_heads", [(9, 3), (4, 1), (8, 2), (6, 6)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_attention_rows_do_not_depend_on_how_the_threads_cut_the_heads(kernel, heads, kv_heads, dtype):
    """With 1, 2 or 3 threads the heads and rows are cut into tasks differently (a one-token
    step's query heads into one run a thread, a kv head's heads split between two threads; a
    block's into a task per kv head and row; the AMX class's bfloat16 cache into runs of (row,
    head) units taken 16 at a time, 7 rows of 3 heads cutting a row's heads between two tiles),
    and a head runs in a block of 1, 2 or 3 heads: every row gets the bits of its one-query call
    on one thread, causal and with a tree mask, over a float32 and a bfloat16 cache. (A bfloat16
    output's rounding hides a one-ulp change in the scale, which the float32 cases catch; the
    bfloat16 ones catch a 1% change, 9 of 16 cases, and guard the bfloat16 instantiation.)"""
    generator = torch.Generator().manual_seed(5)
    keys, values = (torch.randn(1, kv_heads, 48, 64, generator=generator).to(dtype) for _ in range(2))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        q = torch.randn(1, heads, 7, 64, generator=generator).to(dtype)
        mask = torch.rand(7, 40, generator=generator) < 0.7
        mask[:, 0] = True
        expected = {}
        for n in (1, 2, 5, 7):
            for i in range(n):
                row = q[:, :, i: i + 1]
                expected[n, i] = rows.attention(row, keys, values, 40 - n + i + 1, None, 0.125, kernel)[:, 0]
                seen = mask[i].nonzero()[:, 0]
                gathered = [t[:, :, seen].contiguous() for t in (keys, values)]
                expected[n, i, "tree"] = rows.attention(row, *gathered, len(seen), None, 0.125, kernel)[:, 0]
        for count in (1, 2, 3):
            torch.set_num_threads(count)
            for n in (1, 2, 5, 7):
                causal = rows.attention(q[:, :, :n], keys, values, 40, None, 0.125, kernel)
                tree = rows.attention(q[:, :, :n], keys, values, 40, mask[:n], 0.125, kernel)
                for i in range(n):
                    assert torch.equal(causal[:, i], expected[n, i]), (count, n, i)
                    assert torch.equal(tree[:, i], expected[n, i, "tree"]), (count, n, i)
    finally:
        torch.set_num_threads(threads)

@functools.cache
def builtin(dtype: str) -> torch.nn.Module:
    """The built-in model in `dtype`, loaded once for this file's tests (the as-stored GGUF target
    takes ~8 s to load; each test restores what it changes)."""
    return load_model(DEFAULT_MODEL, dtype).model

# The as-stored GGUF target under slow here (its load, ~11 s on the AVX2 EPYC, checks every layer's
# kernel against its blocks): tests/test_gguf_blocks.py holds it to the 4-bit target bit for bit.
AS_STORED = pytest.param("gguf", marks=pytest.mark.slow)


@pytest.mark.parametrize("dtype", ["bfloat16", "int4", AS_STORED])
def test_the_lean_targets_run_on_the_row_kernels(dtype):
    """The built-in model's 4-bit, as-stored and bfloat16 targets multiply and attend through the
    row kernels (so tests/test_invariance.py's blocks, trees and batches test them), and say so."""
    model = builtin(dtype)
    weights = LeanWeights.of(model)
    assert weights.row_kernel_attention
    if dtype == "int4":
        assert isinstance(weights.layers[0].qkv, RowsInt4Kernel)
        assert isinstance(weights.head, RowsInt8Kernel)  # the GGUF's Q8_0 head, its own blocks
    elif dtype == "gguf":  # the file's Q4_1 layers and Q8_0 head, their own blocks
        qkv, head = weights.layers[0].qkv, weights.head
        assert isinstance(qkv, RowsBlocksKernel) and qkv.name.startswith("Q4_1: 4-bit codes")
        assert isinstance(head, RowsBlocksKernel) and head.name.startswith("Q8_0: 8-bit codes")
    else:
        assert isinstance(weights.layers[0].qkv, rows.DenseProduct)
    kernel = CachedModel(model).kernel
    chosen = rows.choice()
    assert rows.name() in kernel and "attention verispec rows" in kernel
    assert f"row kernels {chosen.name}: {chosen.why}" in kernel  # which class, and why


@pytest.mark.parametrize("dtype", ["int4", AS_STORED, "bfloat16", "float32"])
def test_the_layer_loop_in_cpp_gives_the_python_loops_bits(dtype):
    """The 4-bit, as-stored, bfloat16 and float32 targets run their decoder layers in one C++
    call (rows.cpp's Stack, lean.native_layers; bfloat16 and float32 with their RMSNorm modules'
    ops, float32 with oneDNN's products padded to the rows an invariant pass multiplies): the
    bits of lean.forward_rows' Python loop, for one-token steps, blocks of 2..17 rows, a tree,
    and the states after given layers (EAGLE's features)."""
    model = builtin(dtype)
    assert_the_cpp_loop_gives_the_python_loops_bits(LeanWeights.of(model), 49152, prompt=30)


def test_the_float32_layer_loop_pads_a_lone_row_where_a_product_rounds_one_apart():
    """Where a float32 product rounds a lone row apart from the same row among others (oneDNN on
    an AVX-512 EPYC: `LeanWeights.paired`), the C++ layer loop pads a one-token step's rows, so a
    step's logits are the bits of the same position in a block. Skipped, by name, on a CPU whose
    products round every row count alike: padding moves no bit there (it may still pay in time)."""
    model = builtin("float32")
    weights = LeanWeights.of(model)
    if not weights.paired:
        pytest.skip("no float32 product on this CPU rounds a lone row apart: padding moves no bit here")
    assert weights.native is not None and weights.pads
    tokens = torch.randint(0, 49152, (14,), generator=torch.Generator().manual_seed(0))
    steps, block = LeanDecoder(weights, model.device), LeanDecoder(weights, model.device)
    block.forward(tokens[:10])
    steps.forward(tokens[:10])
    stepped = torch.cat([steps.logits(steps.forward(tokens[i: i + 1])) for i in range(10, 14)])
    assert torch.equal(stepped, block.logits(block.forward(tokens[10:])))


@pytest.mark.parametrize("dtype", ["int4", AS_STORED, "bfloat16"])
def test_a_forward_gives_the_same_bits_on_one_thread_and_on_two(dtype):
    """The kernels split a product by output tiles and attention by heads, never a sum, so a
    position's bits do not depend on the thread count: `make test` runs its workers on one thread
    each, users run on all their cores. A prompt block, one-token steps and a block of 5, the
    built-in model's shapes, through the head."""
    model = builtin(dtype)
    weights = LeanWeights.of(model)
    generator = torch.Generator().manual_seed(3)
    steps = [torch.randint(0, 49152, (n,), generator=generator) for n in (40, 1, 5, 1)]
    threads = torch.get_num_threads()
    outputs = []
    try:
        for count in (1, 2):
            torch.set_num_threads(count)
            decoder = LeanDecoder(weights, model.device)
            outputs.append([decoder.logits(decoder.forward(tokens)) for tokens in steps])
    finally:
        torch.set_num_threads(threads)
    assert outputs[0][1].shape == (1, 49152)
    for one, two in zip(*outputs):
        assert torch.equal(one, two)


def test_turned_off_the_previous_kernels_run():
    """VERISPEC_KERNELS=off: torch's int4 kernel, oneDNN and row-by-row SDPA, named as such."""
    code = ("from tests.tiny import tiny_llama; from verispec.model.lowbit import int4_target;"
            "from verispec.model.cached_model import CachedModel; import torch;"
            "m = tiny_llama(hidden=64); int4_target(m, None); c = CachedModel(m);"
            "c.forward(torch.tensor([3, 4, 5])); c.forward(torch.tensor([6, 7])); print(c.kernel)")
    env = dict(os.environ, VERISPEC_KERNELS="off")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert "aten int4pack" in out.stdout and "verispec rows" not in out.stdout


def test_a_tiny_int4_target_computes_its_weights():
    """The tiny 4-bit target's lean forward through the row kernels gives the logits of a float
    model holding the weights its codes stand for, up to bfloat16 activations: the kernels compute
    the model, not merely something row-invariant."""
    model = tiny_llama(hidden=64)
    int4_target(model, None)
    target = CachedModel(model)
    assert isinstance(target.lean.weights.layers[0].qkv, RowsInt4Kernel)
    tokens = torch.tensor([3, 9, 27, 5, 8])
    logits = torch.cat([target.forward(tokens[:3]), target.forward(tokens[3:4]), target.forward(tokens[4:])])
    plain = tiny_llama(hidden=64)
    with torch.no_grad():
        for name, module in model.named_modules():
            if hasattr(module, "stored"):  # a QuantLinear: its weights as float32
                plain.get_submodule(name).weight.copy_(module.weight)
        reference = plain(tokens[None]).logits[0]
    assert (logits - reference).abs().max() < 0.02 * reference.abs().max()


@pytest.mark.slow
@pytest.mark.skipif("avx512-bf16" not in rows.supported(),
                    reason="needs AVX512-BF16 (avx512-bf16): the tiles' emulation is AVX-512 code")
def test_the_amx_class_passes_its_tests_with_the_tiles_emulated():
    """The AMX class's own code (its tile layouts, padding to 16 rows, loops), on any CPU with
    AVX512-BF16: its product, attention and invariance cases (the built-in model's included) in a
    process whose library emulates the tile instructions (build.py's VERISPEC_AMX_EMULATED), every
    case run, none skipped for want of the class. A CPU with AMX runs the same cases on its tiles
    in the suite itself."""
    env = {key: value for key, value in os.environ.items() if key != "VERISPEC_KERNELS"}
    env[build.EMULATED] = "1"
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs",
                          "-m", "slow or not slow", "-k", "amx and not emulated",
                          "tests/test_row_kernels.py", "tests/test_invariance.py"],
                         env=env, cwd=Path(__file__).resolve().parent.parent, capture_output=True,
                         text=True, timeout=1800)
    assert run.returncode == 0, run.stdout[-4000:]
    passed = re.search(r"(\d+) passed", run.stdout)
    assert passed and int(passed.group(1)) >= 30, run.stdout[-2000:]
    assert "this CPU lacks it" not in run.stdout


@pytest.mark.skipif(len(set(rows.SAME_BITS) & set(rows.supported())) < 2,
                    reason="needs AVX512-BF16 and AVX2 (avx512-bf16, avx2): this CPU lacks one")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_avx2_gives_avx512_bf16s_bits(dtype):
    """AVX2/FMA spells AVX512-BF16's arithmetic (rows.cpp), so a target's outputs do not depend
    on which of the two the probe chose: every product kind and attention (causal, 40 and 33 keys,
    head dims 16, 64 and 128), torch.equal."""
    x = activations(dtype=dtype)
    by_class = {kernel: products(kernel) for kernel in rows.SAME_BITS}
    first, *others = by_class
    for kind in KINDS:
        assert all(torch.equal(by_class[first][kind][0](x), by_class[k][kind][0](x)) for k in others), kind
    for head_dim in (16, 64, 128):
        q, keys, values = attention_inputs(dtype, head_dim)
        for length in (40, 33):
            expected = rows.attention(q, keys, values, length, None, 0.125, first)
            assert all(torch.equal(rows.attention(q, keys, values, length, None, 0.125, k), expected)
                       for k in others)


def test_the_choice_is_the_fastest_class_that_keeps_rows_invariant(monkeypatch):
    """`choose` takes the fastest class the probe found row-invariant and says why; the probe
    itself finds every class this CPU runs invariant."""
    measured = rows.probe(rows.supported())
    assert set(measured) == set(rows.supported()) and None not in measured.values()
    monkeypatch.setattr(rows, "probe", lambda names: {"avx512-bf16": 0.002, "avx2": 0.001})
    chosen = rows.choose(["avx512-bf16", "avx2"])
    assert chosen.name == "avx2" and "fastest of {avx512-bf16 2.00 ms, avx2 1.00 ms}" in chosen.why
    monkeypatch.setattr(rows, "probe", lambda names: {"avx512-bf16": 0.002, "avx2": None})
    assert rows.choose(["avx512-bf16", "avx2"]).name == "avx512-bf16"
    monkeypatch.setattr(rows, "probe", lambda names: {"avx2": None})
    assert rows.choose(["avx2"]).name is None


@pytest.mark.parametrize("kernel", KERNELS)
def test_a_forced_class_runs_and_is_named(kernel):
    """VERISPEC_KERNELS=<class> runs that class, and the stats say so; an unknown class is a
    clear error."""
    code = ("from tests.tiny import tiny_llama; from verispec.model.lowbit import int4_target;"
            "from verispec.model.cached_model import CachedModel; import torch;"
            "m = tiny_llama(hidden=64); int4_target(m, None); c = CachedModel(m);"
            "c.forward(torch.tensor([3, 4, 5])); print(c.kernel)")
    env = dict(os.environ, VERISPEC_KERNELS=kernel)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert f"({rows.name(kernel)}, bfloat16 activations)" in out.stdout
    assert f"row kernels {kernel}: forced (VERISPEC_KERNELS={kernel})" in out.stdout
    if kernel != KERNELS[0]:
        return  # the unknown class once (each check starts a process)
    env["VERISPEC_KERNELS"] = "avx1024"
    failed = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert failed.returncode != 0 and "VERISPEC_KERNELS='avx1024': expected one of" in failed.stderr


def test_the_choice_is_cached_per_cpu_and_build(monkeypatch, tmp_path):
    """The first process on a machine probes and writes its choice under the cache directory,
    keyed by CPU model and flags, torch and the kernels' build; the next reads it, probing
    nothing."""
    monkeypatch.delenv("VERISPEC_KERNELS", raising=False)
    monkeypatch.setattr(rows, "cache_dir", lambda: tmp_path)
    probed = []
    monkeypatch.setattr(rows, "probe", lambda names: probed.append(names) or dict.fromkeys(names, 0.001))
    rows.choice.cache_clear()
    try:
        first = rows.choice()
        rows.choice.cache_clear()
        second = rows.choice()
    finally:
        rows.choice.cache_clear()
    assert (tmp_path / f"choice-{rows.cpu_key()}.json").is_file()
    assert second.name == first.name and second.why == first.why + " (cached)"
    assert len(probed) == (1 if len(rows.supported()) > 1 else 0)


def test_stats_name_the_attention_arithmetic_the_class_runs():
    """The AMX class takes a bfloat16 cache's scores from tiles (heads a multiple of 32 wide);
    every other case, and every other class, attends in float32 throughout."""
    assert rows.attention_arithmetic(torch.bfloat16, 64, "amx-bf16").startswith("AMX tiles")
    assert rows.attention_arithmetic(torch.bfloat16, 16, "amx-bf16") == "float32"
    assert rows.attention_arithmetic(torch.float32, 64, "amx-bf16") == "float32"
    for kernel in ("avx512-bf16", "avx2"):
        assert rows.attention_arithmetic(torch.bfloat16, 64, kernel) == "float32"
