"""GGUF files as stored (`--dtype gguf`): every block type is read into codes, float32 scales and
minimums whose values are exactly gguf-py's dequantization; a model loaded from a file runs each
tensor in its own type, exactly, batch-invariant, and every method that needs no training gives
plain decoding's tokens on it. The files are written here (gguf-py's GGUFWriter; its quantize for
the legacy types, random blocks with sane scales for the K-quants, which it cannot quantize)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader, GGUFWriter
from gguf.quants import dequantize, quantize

from tests import test_invariance as invariance
from tests.tiny import tiny_llama
from verispec.core.errors import VerispecError
from verispec.core.stopping import StoppingRules
from verispec.methods import build_engine
from verispec.target.cached_model import CachedModel
from verispec.target.gguf_blocks import QTYPES, Blocks, gguf_target, gguf_tensors, read_blocks, stored_types
from verispec.target.lean import LeanWeights
from verispec.target.lowbit import GGUF_LINEARS, QuantLinear, llama_q_k_rows, weight_format
from verispec.target.models import LoadedModel, load_model

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
    for qtype in QTYPES:  # the stats name the kernel of each type
        assert f"{qtype}: its values in float32" in stats.kernel
    for module in target.model.modules():
        if isinstance(module, QuantLinear):
            assert isinstance(module.stored, Blocks)
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
    tokens = torch.randint(3, 64, (invariance.PREFIX + 17,), generator=torch.Generator().manual_seed(0))
    assert invariance.blocks_differing(weights, tokens, invariant=True) == []
    invariance.test_tree_nodes_match_their_paths(weights, tokens)
    invariance.test_batch_rows_match_alone(weights, tokens)


def test_methods_are_exact_on_the_stored_target(target):
    """Greedy pld, suffix, lookahead and self-int4 give `ar`'s tokens; each drafted, and some
    drafts were kept (this random model seldom repeats itself, so pld and suffix keep few)."""
    prompts = [[1, 17, 42, 9, 33, 17, 42, 5, 17, 42, 9, 33], [1, 60, 7]]
    plain = build_engine(target, "ar")
    references = [plain.generate(prompt, StoppingRules.build(32)).token_ids for prompt in prompts]
    accepted = 0
    for method in ("pld", "suffix", "lookahead", "self-int4"):
        engine = build_engine(target, method)
        results = [engine.generate(prompt, StoppingRules.build(32)) for prompt in prompts]
        assert [r.token_ids for r in results] == references, method
        assert sum(step.draft_depth for r in results for step in r.steps) > 0, method
        accepted += sum(step.num_accepted for r in results for step in r.steps)
    assert accepted > 0


def test_dtype_gguf_needs_a_gguf_file(tiny_dir):
    with pytest.raises(VerispecError, match="--dtype gguf runs a GGUF file's tensors as stored"):
        load_model(str(tiny_dir), "gguf")
