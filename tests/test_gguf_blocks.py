"""GGUF files as stored (`--dtype gguf`): every block type is read into codes, float32 scales and
minimums whose values are exactly gguf-py's dequantization; each type runs on the row kernels
(where they run) multiplying by exactly those values, row-invariant; a model loaded from a file
runs each tensor in its own type, exactly, batch-invariant, and every method that needs no
training gives plain decoding's tokens on it; the built-in SmolLM2 file as stored is its 4-bit
target (`--dtype int4`), bit for bit. The files are written here (gguf-py's GGUFWriter; its
quantize for the legacy types, random blocks with sane scales for the K-quants, which it cannot
quantize)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader, GGUFWriter
from gguf.quants import dequantize, quantize

from tests import test_invariance as invariance
from tests.test_row_kernels import rows_differing
from tests.tiny import tiny_llama
from verispec.core.errors import VerispecError
from verispec.core.stopping import StoppingRules
from verispec.decoding.sequence import SequenceSpec
from verispec.methods import build_engine
from verispec.model import gguf_blocks
from verispec.model.cached_model import CachedModel
from verispec.model.gguf_blocks import (
    QTYPES,
    ROW_CODES,
    Blocks,
    DequantizedKernel,
    Fused,
    RowsBlocksKernel,
    exact_kernel,
    gguf_target,
    gguf_tensors,
    kernel_weights,
    own_int4,
    read_blocks,
    stored_types,
)
from verispec.model.kernels import rows
from verispec.model.lean import LeanWeights
from verispec.model.loading import DEFAULT_MODEL, LoadedModel, load_model
from verispec.model.lowbit import GGUF_LINEARS, QuantLinear, llama_q_k_rows, weight_format
from verispec.request import encode_prompt

ROWS_RUN = pytest.mark.skipif(not rows.available(), reason=f"row kernels: {rows.unavailable_reason()}")

# code range per type: (lowest, highest), as the files here use them (a Q8_0 quantizer stays in +-127)
CODES = {"Q4_0": (-8, 7), "Q4_1": (0, 15), "Q5_0": (-16, 15), "Q5_1": (0, 31), "Q8_0": (-127, 127),
         "Q4_K": (0, 15), "Q5_K": (0, 31), "Q6_K": (-32, 31)}
# where a K-quant block keeps its fp16 super-scales (d, then dmin)
K_SCALES = {"Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}


def raw_blocks(qtype: str, rows: int, columns: int, rng: np.random.Generator) -> np.ndarray:
    """A tensor's bytes [rows, bytes per row] in `qtype`: gguf-py's quantization of random
    weights, or (K-quants) random blocks whose fp16 scales are small and positive."""
    kind = GGMLQuantizationType[qtype]
    if qtype not in K_SCALES:
        return quantize(rng.standard_normal((rows, columns)).astype(np.float32), kind)
    block, size = GGML_QUANT_SIZES[kind]
    raw = rng.integers(0, 256, (rows * columns // block, size), dtype=np.uint8)
    for at in K_SCALES[qtype]:
        raw[:, at: at + 2] = rng.uniform(1e-3, 1e-2, (raw.shape[0], 1)).astype(np.float16).view(np.uint8)
    return raw.reshape(rows, -1)


def write(path: Path, tensors: dict[str, tuple[str, np.ndarray]]) -> Path:
    writer = GGUFWriter(path, "llama")
    for name, (qtype, raw) in tensors.items():
        writer.add_tensor(name, raw, raw_dtype=GGMLQuantizationType[qtype])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def every_type(tmp_path_factory) -> tuple[Path, dict[str, np.ndarray]]:
    """One 48 x 512 tensor of each type in one file, and the bytes written."""
    rng = np.random.default_rng(0)
    raws = {qtype: raw_blocks(qtype, 48, 512, rng) for qtype in QTYPES}
    path = write(tmp_path_factory.mktemp("gguf") / "types.gguf",
                 {f"t.{qtype}": (qtype, raw) for qtype, raw in raws.items()})
    return path, raws


@pytest.mark.parametrize("qtype", list(QTYPES))
def test_each_type_reads_into_codes_scales_and_minimums_exactly(every_type, qtype):
    path, raws = every_type
    _, tensors = gguf_tensors(path)
    tensor = tensors[f"t.{qtype}"]
    assert tensor.qtype == qtype and tensor.shape == (512, 48)
    assert np.array_equal(tensor.data, raws[qtype])  # the header reader finds the bytes written
    reference = next(t for t in GGUFReader(path).tensors if t.name == f"t.{qtype}")
    assert np.array_equal(tensor.data, reference.data)  # where gguf-py's own reader finds them
    blocks = read_blocks(tensor.data, qtype, 48, 512)
    group, bits = QTYPES[qtype]
    assert blocks.group == group and blocks.bits == bits and blocks.codes.dtype == torch.int8
    assert blocks.scales.dtype == blocks.mins.dtype == torch.float32
    low, high = CODES[qtype]
    assert int(blocks.codes.min()) >= low and int(blocks.codes.max()) <= high
    assert int(blocks.codes.min()) == low and int(blocks.codes.max()) == high  # the range is used
    expected = torch.from_numpy(dequantize(tensor.data, GGMLQuantizationType[qtype]))
    assert torch.equal(blocks.dequantize(), expected)
    size, at = GGML_QUANT_SIZES[GGMLQuantizationType[qtype]][1], K_SCALES.get(qtype, (0,))[0]
    d = torch.from_numpy(raws[qtype].reshape(-1, size)[:, at: at + 2].copy().view(np.float16)).float()
    per_block = blocks.scales.reshape(d.shape[0], -1)
    if qtype in ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"):
        assert torch.equal(per_block[:, 0], d[:, 0])  # the block's own fp16 scale, exactly
    else:  # a K-quant's group scale is d times a small integer, rounded to float32 once
        ratio = per_block / d
        assert torch.equal(ratio, ratio.round()) and float(ratio.max()) <= 127


def test_q4_k_scales_are_not_held_by_bfloat16(every_type):
    """The reason for float32 scales: a K-quant's d * sc rounds in bfloat16 (torch's int4
    kernel keeps its scales there)."""
    path, _ = every_type
    blocks = read_blocks(gguf_tensors(path)[1]["t.Q4_K"].data, "Q4_K", 48, 512)
    assert not torch.equal(blocks.scales.to(torch.bfloat16).float(), blocks.scales)


# ---- each type's kernel ----------------------------------------------------------------------


def type_blocks(every_type, qtype: str) -> Blocks:
    path, _ = every_type
    return read_blocks(gguf_tensors(path)[1][f"t.{qtype}"].data, qtype, 48, 512)


def assert_exact(kernel, stored: Blocks | Fused) -> None:
    """Products with every unit vector give the blocks' values, bit for bit."""
    width = stored.dequantize().shape[1]
    assert torch.equal(kernel_weights(kernel, torch.arange(width), width), stored.dequantize())


@ROWS_RUN
@pytest.mark.parametrize("qtype", list(QTYPES))
def test_each_type_runs_on_the_row_kernels_exactly_and_row_invariant(every_type, qtype):
    """Each type's kernel is the row kernel over the file's own codes (4-bit ones as nibbles,
    wider ones as bytes; minimums only where the type has them): its products with unit vectors
    are the blocks' values, bit for bit; every block of 1..17 rows gives each row the bits it has
    among all 17 (float32 and bfloat16 activations); and it computes the product it stands for."""
    blocks = type_blocks(every_type, qtype)
    kernel = exact_kernel(blocks)
    assert isinstance(kernel, RowsBlocksKernel)
    assert kernel.name.startswith(f"{qtype}: {blocks.bits}-bit codes")
    (product,) = kernel.products
    assert product.nibbles == (blocks.bits == 4) and product.group == blocks.group
    assert (product.mins is None) == (not ROW_CODES[qtype][1])
    assert_exact(kernel, blocks)
    x = torch.randn(17, 512, generator=torch.Generator().manual_seed(3))
    for dtype in (torch.float32, torch.bfloat16):
        assert rows_differing(kernel, x.to(dtype)) == []
    expected = x.to(torch.bfloat16).double() @ blocks.dequantize().double().T
    assert (kernel(x).double() - expected).abs().max() <= 1e-5 * expected.abs().max()


@ROWS_RUN
def test_a_product_fused_over_types_runs_each_in_its_own_form(every_type):
    """q/k/v stored in several types: parts the kernel takes alike (Q5_0 and Q8_0: bytes, groups
    of 32, no minimums) stack into one product; others (Q4_K nibbles with minimums, Q6_K's groups
    of 16) run as their own, outputs concatenated; exact and row-invariant either way."""
    parts = [type_blocks(every_type, qtype) for qtype in ("Q5_0", "Q8_0", "Q4_K", "Q6_K", "Q4_0")]
    fused = Blocks.cat(parts)
    assert isinstance(fused, Fused) and fused.types == "Q5_0+Q8_0+Q4_K+Q6_K+Q4_0"
    kernel = exact_kernel(fused)
    assert [(p.out_features, p.nibbles, p.group) for p in kernel.products] == [
        (96, False, 32), (48, True, 32), (48, False, 16), (48, True, 32)]
    assert_exact(kernel, fused)
    assert rows_differing(kernel, torch.randn(17, 512, generator=torch.Generator().manual_seed(4))) == []


@ROWS_RUN
@pytest.mark.parametrize(("qtype", "broken"), [("Q4_0", (7, True)), ("Q6_K", (32, False)),
                                                ("Q4_1", (0, False)), ("Q8_0", (0, True))])
def test_a_wrong_mapping_onto_the_row_kernel_is_refused(every_type, monkeypatch, qtype, broken):
    """The check at build time catches a type mapped wrongly onto the kernel (an offset off by one,
    Q6_K's codes taken without their offset, Q4_1's minimums dropped; Q8_0 given minimums is
    harmless, zero, and passes): the check compares with the blocks' values, not the mapping."""
    blocks = type_blocks(every_type, qtype)
    monkeypatch.setitem(ROW_CODES, qtype, broken)
    if qtype == "Q8_0":
        assert_exact(exact_kernel(blocks), blocks)
        return
    with pytest.raises(VerispecError, match="does not multiply by its blocks' values exactly"):
        exact_kernel(blocks)


@pytest.mark.parametrize("qtype", list(QTYPES))
def test_without_the_row_kernels_each_type_runs_on_its_values_in_float32(every_type, monkeypatch, qtype):
    """Where the row kernels do not run (no AVX512-BF16, no compiler), each type runs on its
    values in float32 (oneDNN), exact, and says so."""
    monkeypatch.setattr(gguf_blocks.rows, "available", lambda: False)
    blocks = type_blocks(every_type, qtype)
    kernel = exact_kernel(blocks)
    assert isinstance(kernel, DequantizedKernel) and kernel.name.startswith(f"{qtype}: its values in float32")
    assert_exact(kernel, blocks)


def test_4bit_types_give_drafters_their_own_codes(every_type):
    """Q4_0, Q4_1 and Q4_K blocks are 4-bit groups of 32 with the same values (Q4_0's q - 8 as q
    with minimum -8 d, exactly), so a self drafter takes a GGUF target's own codes; wider types
    are not."""
    for qtype in QTYPES:
        blocks = type_blocks(every_type, qtype)
        module = QuantLinear(blocks, DequantizedKernel, None)
        groups = own_int4(module)
        if qtype in ("Q4_0", "Q4_1", "Q4_K"):
            assert groups is not None and int(groups.codes.max()) == 15 and int(groups.codes.min()) == 0
            assert torch.equal(groups.dequantize(), blocks.dequantize())
        else:
            assert groups is None


# ---- a model loaded from a file --------------------------------------------------------------

# Each layer's tensors in other types (a K-quant file mixes them); the head in Q8_0.
LAYER_TYPES = [{"attn_q": "Q5_0", "attn_k": "Q4_K", "attn_v": "Q8_0", "attn_output": "Q4_1",
                "ffn_gate": "Q5_K", "ffn_up": "Q4_0", "ffn_down": "Q6_K"},
               {"attn_q": "Q4_K", "attn_k": "Q5_1", "attn_v": "Q6_K", "attn_output": "Q5_K",
                "ffn_gate": "Q8_0", "ffn_up": "Q5_0", "ffn_down": "Q4_K"}]


@pytest.fixture(scope="module")
def stored(tmp_path_factory) -> tuple[Path, torch.nn.Module]:
    """A tiny Llama (256 wide: K-quants come in 256-weight blocks) whose weights are a GGUF
    file's dequantized blocks, as transformers loads them; layer 0's q and k stored in llama.cpp's
    row order (rotary halves interleaved), layer 1's in Hugging Face's."""
    rng = np.random.default_rng(1)
    model = tiny_llama(seed=4, layers=2, hidden=256)
    tensors = {}
    heads = {"attn_q": model.config.num_attention_heads, "attn_k": model.config.num_key_value_heads}
    with torch.no_grad():
        for index, layer in enumerate(model.model.layers):
            for short, qtype in LAYER_TYPES[index].items():
                module = layer.get_submodule(GGUF_LINEARS[short])
                rows, columns = module.weight.shape
                raw = raw_blocks(qtype, rows, columns, rng)
                values = torch.from_numpy(dequantize(raw, GGMLQuantizationType[qtype]))
                if index == 0 and short in heads:
                    values = values[llama_q_k_rows(rows, heads[short])]
                module.weight.copy_(values)
                tensors[f"blk.{index}.{short}.weight"] = (qtype, raw)
        head = model.lm_head.weight
        raw = raw_blocks("Q8_0", *head.shape, rng)
        head.copy_(torch.from_numpy(dequantize(raw, GGMLQuantizationType.Q8_0)))
        tensors["output.weight"] = ("Q8_0", raw)
    return write(tmp_path_factory.mktemp("model") / "tiny.gguf", tensors), model


@pytest.fixture(scope="module")
def target(stored) -> LoadedModel:
    path, model = stored
    kernel = gguf_target(model, path)
    return LoadedModel(model, None, "tiny-gguf", path, kernel)


def test_every_tensor_runs_in_its_own_type(target):
    counts = stored_types(target.model)
    expected: dict[str, int] = {"Q8_0": 1}
    for layer in LAYER_TYPES:
        for qtype in layer.values():
            expected[qtype] = expected.get(qtype, 0) + 1
    assert counts == expected
    assert weight_format(target.model) == "gguf"
    stats = CachedModel(target.model).stats()
    assert stats.dtype == "gguf" and stats.invariance == "row-attention"
    for qtype, (_, bits) in QTYPES.items():  # the stats name the kernel of each type
        runs = f"{bits}-bit codes" if rows.available() else "its values in float32"
        assert f"{qtype}: {runs}" in stats.kernel
    for module in target.model.modules():
        if isinstance(module, QuantLinear):
            assert isinstance(module.stored, Blocks)
            assert isinstance(module.kernel, RowsBlocksKernel if rows.available() else DequantizedKernel)
            x = torch.randn(3, module.in_features)
            assert torch.equal(module(x), module.kernel(x))


def test_a_weight_that_is_not_the_files_is_refused(stored, tmp_path):
    path, _ = stored
    other = tiny_llama(seed=4, layers=2, hidden=256)  # its own random weights
    with pytest.raises(VerispecError, match="is not the weight the model loaded"):
        gguf_target(other, path)
    assert not any(isinstance(m, QuantLinear) for m in other.modules())  # nothing half-converted


@torch.no_grad()
def test_the_stored_target_is_batch_invariant(target):
    weights = LeanWeights.of(target.model)
    if rows.available():  # layer 0's q/k/v: Q5_0 | Q4_K | Q8_0, gate/up: Q5_K | Q4_0, each its own form
        assert [len(p.products) for p in (weights.layers[0].qkv, weights.layers[0].gate_up)] == [3, 2]
    tokens = torch.randint(3, 64, (invariance.PREFIX + 17,), generator=torch.Generator().manual_seed(0))
    assert invariance.blocks_differing(weights, tokens, invariant=True) == []
    invariance.test_tree_nodes_match_their_paths(weights, tokens)
    invariance.test_batch_rows_match_alone(weights, tokens)


def test_methods_are_exact_on_the_stored_target(target):
    """Greedy pld, suffix, lookahead and self-int4 give `ar`'s tokens; each drafted, and some
    drafts were kept (this random model seldom repeats itself, so pld and suffix keep few)."""
    prompts = [[1, 17, 42, 9, 33, 17, 42, 5, 17, 42, 9, 33], [1, 60, 7]]
    plain = build_engine(target, "ar")
    references = [plain.generate(
        SequenceSpec(prompt, StoppingRules.build(32))).token_ids for prompt in prompts]
    accepted = 0
    for method in ("pld", "suffix", "lookahead", "self-int4"):
        engine = build_engine(target, method)
        results = [engine.generate(SequenceSpec(prompt, StoppingRules.build(32))) for prompt in prompts]
        assert [r.token_ids for r in results] == references, method
        assert sum(step.draft_depth for r in results for step in r.steps) > 0, method
        accepted += sum(step.num_accepted for r in results for step in r.steps)
    assert accepted > 0


@ROWS_RUN
def test_the_builtin_file_as_stored_is_the_4bit_target():
    """`--dtype gguf` on the built-in SmolLM2 file (its 210 Q4_1 layers and its Q8_0 head on the
    row kernels) is the 4-bit target docs/int4.md describes (`--dtype int4`: the file's Q4 blocks,
    its Q8_0 head recovered from the loaded weights) bit for bit: a prompt, a block and a step give
    the same logits, and a self-int4 drafter takes the same codes from either."""
    stored, published = load_model(DEFAULT_MODEL, "gguf"), load_model(DEFAULT_MODEL, "int4")
    assert weight_format(stored.model) == "gguf" and stored_types(stored.model) == {"Q4_1": 210, "Q8_0": 1}
    ours, theirs = CachedModel(stored.model), CachedModel(published.model)
    for text in ("Name three rivers.", "Repeat this list twice: apples, pears, plums, cherries."):
        ids = encode_prompt(stored, text, chat=True)
        for block in (ids, [5, 6, 7], [8]):
            assert torch.equal(ours.forward(torch.tensor(block)), theirs.forward(torch.tensor(block)))
        ours.reset()
        theirs.reset()
    layers = dict(published.model.model.layers.named_modules())
    for name, module in stored.model.model.layers.named_modules():
        if isinstance(module, QuantLinear):  # what a self-int4 drafter takes from each target
            mine, its = own_int4(module), own_int4(layers[name])
            for field in ("codes", "scales", "mins"):
                assert torch.equal(getattr(mine, field), getattr(its, field))


def test_dtype_gguf_needs_a_gguf_file(tiny_dir):
    with pytest.raises(VerispecError, match="--dtype gguf runs a GGUF file's tensors as stored"):
        load_model(str(tiny_dir), "gguf")
