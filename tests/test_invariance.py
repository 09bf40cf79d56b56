"""Batch invariance of the lean forward: a position's logits and keys/values are a function of
its token prefix only, bitwise (torch.equal), whether computed one token at a time, in a
verification block of any length 2..17, as a node of a token tree, or as a row of a batch beside
sequences of other lengths. Switched off (invariant=False), the same checks fail: the test below
shows it, so these tests are known to exercise the switch.

Each case runs on the CPU and, where torch sees a GPU, on CUDA (float32, bfloat16 and float16
there; the 4-bit target is CPU-only): without one the CUDA cases are skipped, never passed. The
CPU cases run on this process's row-kernel class (rows.choice()); the 4-bit and bfloat16 ones
again on each other class this CPU runs (built under VERISPEC_KERNELS=<class>), skipped by name
where it lacks one."""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace

import pytest
import torch

from tests.tiny import tiny_llama
from verispec.core.errors import VerispecError
from verispec.model import lean
from verispec.model.cached_model import CachedModel
from verispec.model.kernels import rows
from verispec.model.lean import ROLES, WIDE_ROWS, Block, LeanDecoder, LeanWeights, Linear, forward_rows
from verispec.model.loading import DEFAULT_MODEL, load_model
from verispec.model.lowbit import int4_target

DTYPES = {"cpu": ("float32", "bfloat16", "int4"), "cuda": ("float32", "bfloat16", "float16")}
PREFIX = 10
NO_CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA: no GPU on this machine")
# Each row-kernel class forced, for the CPU targets that multiply through it: the process's own
# too, so that a case's name is the same on every CPU (scripts/mutate.py names them).
FORCED_KERNELS = [(model, dtype, kernel) for kernel in rows.CLASSES
                  for model in ("tiny", "builtin") for dtype in ("bfloat16", "int4")]


def needs(kernel: str) -> pytest.MarkDecorator:
    """Skip, by name, a class this CPU does not run."""
    label = rows.CLASSES[kernel][2]
    return pytest.mark.skipif(kernel not in rows.supported(),
                              reason=f"needs {label} ({kernel}): this CPU lacks it")


@contextlib.contextmanager
def kernel_class(kernel: str | None) -> Iterator[None]:
    """rows.choice() is `kernel` inside (None: unchanged), as VERISPEC_KERNELS=<kernel> makes it."""
    if kernel is None:
        yield
        return
    before = os.environ.get("VERISPEC_KERNELS")
    os.environ["VERISPEC_KERNELS"] = kernel
    rows.choice.cache_clear()
    try:
        yield
    finally:
        if before is None:
            del os.environ["VERISPEC_KERNELS"]
        else:
            os.environ["VERISPEC_KERNELS"] = before
        rows.choice.cache_clear()


def device_of(weights: LeanWeights) -> torch.device:
    return weights.embed.weight.device


def one_at_a_time(weights: LeanWeights, tokens: torch.Tensor) -> tuple[torch.Tensor, LeanDecoder]:
    """Logits [n, vocab] of every position fed one token per step, and the decoder."""
    decoder = LeanDecoder(weights, device_of(weights))
    return torch.cat([decoder.logits(decoder.forward(tokens[i: i + 1])) for i in range(len(tokens))]), decoder


def same_cache(a: LeanDecoder, b: LeanDecoder, length: int) -> bool:
    return all(torch.equal(x.keys[:, :, :length], y.keys[:, :, :length])
               and torch.equal(x.values[:, :, :length], y.values[:, :, :length])
               for x, y in zip(a.caches, b.caches))


def blocks_differing(weights: LeanWeights, tokens: torch.Tensor, invariant: bool) -> list[int]:
    """Block lengths 2..17 after a one-token-at-a-time prefix whose logits or cache differ."""
    reference, plain = one_at_a_time(weights, tokens)
    decoder = LeanDecoder(weights, device_of(weights), invariant)
    for i in range(PREFIX):
        decoder.forward(tokens[i: i + 1])
    differing = []
    for n in range(2, 18):
        decoder.rewind(PREFIX)  # the prefix's entries were computed one token at a time
        logits = decoder.logits(decoder.forward(tokens[PREFIX: PREFIX + n]))
        if not (torch.equal(logits, reference[PREFIX: PREFIX + n])
                and same_cache(decoder, plain, PREFIX + n)):
            differing.append(n)
    return differing


def assert_the_cpp_loop_gives_the_python_loops_bits(weights: LeanWeights, vocab: int, prompt: int) -> None:
    """`weights`' layers run in one C++ call (rows.cpp's Stack: lean.native_layers) and give the
    bits of lean.forward_rows' Python loop: one-token steps and blocks of 2..17 rows after a prompt
    of `prompt` tokens, the states after given layers (EAGLE's features), and a tree after them
    (past any sliding window the layers have, so the window cuts into the tree's mask)."""
    stack = weights.native
    assert stack is not None
    device = device_of(weights)
    native, python = LeanDecoder(weights, device), LeanDecoder(weights, device)
    hidden = weights.embed.weight.shape[1]
    captured = (0, len(weights.layers) - 1)

    def both(tokens, positions=None, mask=None, layers=()):
        try:
            out = native.forward(tokens, positions, mask, layers)
            weights.native = None
            return out, python.forward(tokens, positions, mask, layers)
        finally:
            weights.native = stack

    generator = torch.Generator().manual_seed(0)
    both(torch.randint(0, vocab, (prompt,), generator=generator))  # the prompt: one causal block either way
    for n in (1, 2, 5, 1, 17, 1):
        a, b = both(torch.randint(0, vocab, (n,), generator=generator), layers=captured)
        assert a.shape == (n, 3 * hidden) and torch.equal(a, b), n
    past = native.length
    parents = [-1, 0, 0, 1, 2]  # a tree: a root, two children, a grandchild under each
    mask = torch.zeros(5, past + 5, dtype=torch.bool)
    mask[:, :past] = True
    depth = []
    for i, parent in enumerate(parents):
        mask[i, past + i] = True
        if parent >= 0:
            mask[i, past:] |= mask[parent, past:]
        depth.append(0 if parent < 0 else depth[parent] + 1)
    a, b = both(torch.randint(0, vocab, (5,), generator=generator), past + torch.tensor(depth), mask)
    assert torch.equal(a, b)


@pytest.fixture(scope="module", params=[
    pytest.param((model, dtype, device, None), marks=NO_CUDA if device == "cuda" else (),
                 id=f"{model}-{dtype}-{device}")
    for device in DTYPES for model in ("tiny", "builtin") for dtype in DTYPES[device]] + [
    pytest.param((model, dtype, "cpu", kernel), id=f"{model}-{dtype}-cpu-{kernel}",
                 marks=[needs(kernel)] + ([pytest.mark.slow] if model == "builtin" else []))
    for model, dtype, kernel in FORCED_KERNELS] + [
    pytest.param(("tiny", "float32", "static", None), id="tiny-float32-cpu-static")] + [
    pytest.param((model, "float32", f"cpu-{rows_}", None), id=f"{model}-float32-cpu-{rows_}",
                 marks=[pytest.mark.slow] if model == "builtin" else [])
    for model in ("tiny", "builtin") for rows_ in ("narrow", "wide")] + [
    pytest.param(("tiny", "float32", "cpu-python", None), id="tiny-float32-cpu-python")])
def weights(request) -> LeanWeights:
    """A tiny Llama, and the built-in model (SmolLM2-135M), in each dtype (int4: the 4-bit
    target, on the GGUF's own blocks for the built-in model), lean, on each device; on the CPU
    also built on each row-kernel class; and the tiny Llama on the CPU through the GPU's
    fixed-shape passes (`static`: graphs.StaticPasses, eager there), so that their masks, slots,
    chunks and trees are checked on every machine; and both in float32 with the fewest rows a
    product takes held to what a lone row needs (`narrow`) or WIDE_ROWS (`wide`, as where that
    streams faster), whichever this machine chose at load (the built-in model's under slow: its
    plain case runs this machine's choice in the default suite); and the tiny Llama through the
    Python layer loop (`python`: as a batch of sequences, Qwen2's biased 4-bit products and a
    decoder that is not invariant run), its products padded to WIDE_ROWS, attending through the
    row kernel where it runs."""
    model, dtype, device, kernel = request.param
    if device in ("cpu-narrow", "cpu-wide", "cpu-python"):  # weights of their own: the cached ones
        module = tiny_llama(hidden=64) if model == "tiny" else load_model(DEFAULT_MODEL, dtype).model
        weights = LeanWeights(module)
        narrow = {role: 2 if role in weights.paired else 1 for role in ROLES}
        weights.min_rows = narrow if device == "cpu-narrow" else dict.fromkeys(ROLES, WIDE_ROWS)
        # the C++ loop holds the rows it pads to from when it was built
        weights.native = None if device == "cpu-python" else lean.native_layers(weights)
        return weights
    if device == "static":
        weights = LeanWeights.of(tiny_llama(hidden=64))
        weights.fixed_rows, weights.static_keys = True, 100
        return weights
    with kernel_class(kernel):
        if model == "builtin":
            weights = LeanWeights.of(load_model(DEFAULT_MODEL, dtype, device).model)
        else:
            tiny = tiny_llama(hidden=64)
            if dtype == "int4":
                int4_target(tiny, None)
                weights = LeanWeights.of(tiny)
            else:
                weights = LeanWeights.of(tiny.to(device, getattr(torch, dtype)))
    if kernel is not None:  # attention and products on that class
        assert weights.row_kernel == kernel and rows.name(kernel) in weights.layers[0].qkv.name
    return weights


@pytest.fixture(scope="module")
def tokens(weights) -> torch.Tensor:
    return torch.randint(3, 64, (PREFIX + 17,), generator=torch.Generator().manual_seed(0)).to(
        device_of(weights))


@torch.no_grad()
def test_blocks_of_every_length_match_one_token_steps(weights, tokens):
    assert blocks_differing(weights, tokens, invariant=True) == []


@dataclass(frozen=True)
class Timed(Linear):
    """A prepacked product that takes `few` seconds over fewer than WIDE_ROWS rows, else `many`."""

    few: float = 0.0
    many: float = 0.0

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(self.few if x.shape[-2] < WIDE_ROWS else self.many)
        return super().__call__(x)


def test_few_rows_are_padded_wide_only_where_that_is_timed_faster():
    """wide_pays times the model's products streamed at the fewest rows a lone row needs and at
    WIDE_ROWS: products slower on few rows choose wide, the reverse narrow, and a tiny model
    (whose sweep takes under WIDE_FLOOR) stays narrow whatever its timings say."""
    model = tiny_llama(hidden=64)
    weights = LeanWeights(model)
    assert weights.min_rows == {role: 2 if role in weights.paired else 1 for role in ROLES}
    config = model.config
    widths = {"qkv": 64, "out": 64, "gate_up": 64, "down": config.intermediate_size, "head": 64}
    assert not lean.wide_pays(weights, widths)  # a tiny model: not judged

    def timed(few: float, many: float) -> LeanWeights:
        def slow(product: Linear) -> Timed:
            return Timed(product.packed, product.bias, few, many)
        weights.layers = [replace(layer, qkv=slow(layer.qkv), out=slow(layer.out),
                                  gate_up=slow(layer.gate_up), down=slow(layer.down))
                          for layer in LeanWeights(model).layers]
        weights.head = slow(LeanWeights(model).head)
        return weights

    assert lean.wide_pays(timed(0.001, 0.0002), widths)
    assert not lean.wide_pays(timed(0.0002, 0.001), widths)


@torch.no_grad()
def test_switched_off_blocks_differ(weights, tokens):
    """Without the invariance, some block lengths round differently (tiny model: float32 all 16,
    bfloat16 6..17): the test above would catch the switch being ignored. The tiny 4-bit model
    has nothing to switch (its blocks already round as single rows), nor has a target whose layers
    run in one C++ call (lean.native_layers: the 4-bit, as-stored and bfloat16 built-in model,
    whose rows attend one by one either way). On CUDA (an H100, torch 2.11) the tiny model's half-precision
    blocks also round as single rows without it; its float32 and the built-in model's bfloat16
    and float16 blocks do not."""
    if weights.layers[0].qkv.__class__.__name__.endswith("Int4Kernel") and weights.heads < 8:
        pytest.skip("the tiny 4-bit model's blocks round as single rows even without the switch")
    if weights.native is not None:
        pytest.skip("its layers run in one C++ call, whose rows attend one by one either way")
    if (device_of(weights).type == "cuda" and weights.embed.weight.dtype != torch.float32
            and weights.heads < 8):
        pytest.skip("the tiny model's half-precision blocks on CUDA round as single rows without the switch")
    assert blocks_differing(weights, tokens, invariant=False) != []


@torch.no_grad()
def test_tree_nodes_match_their_paths(weights, tokens):
    # tree after the prefix: node 0 root; 1, 2 children of 0; 3 child of 2; 4 child of 1
    parents = [-1, 0, 0, 2, 1]
    device = device_of(weights)
    tree_tokens = torch.tensor([11, 12, 13, 14, 15], device=device)
    mask = torch.ones(5, PREFIX + 5, dtype=torch.bool, device=device)
    mask[:, PREFIX:] = False
    depth = []
    for i, parent in enumerate(parents):
        node = i
        while node >= 0:
            mask[i, PREFIX + node] = True
            node = parents[node]
        depth.append(0 if parent < 0 else depth[parent] + 1)
    decoder = LeanDecoder(weights, device)
    for i in range(PREFIX):
        decoder.forward(tokens[i: i + 1])
    tree_logits = decoder.logits(decoder.forward(tree_tokens, torch.tensor(depth, device=device) + PREFIX,
                                                 mask))
    for i in range(5):
        path, node = [], i
        while node >= 0:
            path.insert(0, node)
            node = parents[node]
        reference, plain = one_at_a_time(weights, torch.cat([tokens[:PREFIX], tree_tokens[path]]))
        assert torch.equal(tree_logits[i], reference[-1])
        layer = decoder.caches[-1]
        assert torch.equal(layer.keys[:, :, PREFIX + i], plain.caches[-1].keys[:, :, PREFIX + len(path) - 1])


@torch.no_grad()
def test_batch_rows_match_alone(weights, tokens):
    """Three sequences of different lengths verified in one pass give each row's own bits."""
    prompts = [tokens[:PREFIX], tokens[2: PREFIX + 7], tokens[5:8]]
    drafts = [tokens[PREFIX: PREFIX + 5], tokens[:1], tokens[3:12]]
    decoders = [LeanDecoder(weights, device_of(weights)) for _ in prompts]
    for decoder, prompt in zip(decoders, prompts):
        for i in range(len(prompt)):
            decoder.forward(prompt[i: i + 1])
    hidden = forward_rows(decoders, [Block(d) for d in drafts])
    batch_logits = decoders[0].logits(hidden).split([len(d) for d in drafts])
    for logits, decoder, prompt, draft in zip(batch_logits, decoders, prompts, drafts):
        reference, plain = one_at_a_time(weights, torch.cat([prompt, draft]))
        assert torch.equal(logits, reference[len(prompt):])
        assert same_cache(decoder, plain, len(prompt) + len(draft))


def static_tiny(keys: int = 100) -> LeanWeights:
    """The tiny Llama on the CPU through the GPU's fixed-shape passes (eager there)."""
    weights = LeanWeights.of(tiny_llama(hidden=64))
    weights.fixed_rows, weights.static_keys = True, keys
    return weights


@torch.no_grad()
def test_a_block_longer_than_a_pass_matches_one_token_steps():
    """70 rows run as passes of 32, 32 and 6 rows, each row as its one-token step computes it."""
    weights = static_tiny()
    tokens = torch.randint(3, 64, (75,), generator=torch.Generator().manual_seed(1))
    reference, plain = one_at_a_time(weights, tokens)
    decoder = LeanDecoder(weights, device_of(weights))
    assert decoder.passes is not None  # the fixed-shape passes run, not the CPU's forward
    for i in range(5):
        decoder.forward(tokens[i: i + 1])
    logits = decoder.logits(decoder.forward(tokens[5:]))
    assert torch.equal(logits, reference[5:]) and same_cache(decoder, plain, 75)
    assert decoder.passes.tokens[: 70 - 64].tolist() == tokens[69:].tolist()  # the last pass's rows


@torch.no_grad()
def test_a_sequence_outgrowing_the_fixed_cache_is_a_clear_error():
    weights = static_tiny(keys=20)  # 63 usable slots (a multiple of 64 with the scratch slot)
    decoder = LeanDecoder(weights, device_of(weights))
    decoder.forward(torch.randint(3, 64, (60,)))
    with pytest.raises(VerispecError, match="outgrows the GPU decoder's cache of 63 tokens"):
        decoder.forward(torch.arange(3, 9))
    assert decoder.length == 60  # nothing half-written


@NO_CUDA
@torch.no_grad()
def test_cuda_graphs_replay_the_eager_passes_bit_for_bit(monkeypatch):
    """The built-in model in bfloat16 on CUDA: one-token steps and a 9-token block through
    captured CUDA graphs give the bits of the same passes run eagerly, and the stats say which."""
    model = load_model(DEFAULT_MODEL, "bfloat16", "cuda")
    tokens = torch.randint(3, 5000, (30,), generator=torch.Generator().manual_seed(2)).cuda()
    results = {}
    for graphs in ("on", "off"):
        monkeypatch.setenv("VERISPEC_CUDA_GRAPHS", graphs)
        cached = CachedModel(model.model)
        logits = [cached.forward(tokens[:12])]
        logits += [cached.forward(tokens[i: i + 1]) for i in range(12, 21)]
        logits.append(cached.forward(tokens[21:30]))
        assert ("CUDA graphs" in cached.kernel) == (graphs == "on")
        assert bool(cached.lean.passes.captured) == (graphs == "on")
        results[graphs] = torch.cat(logits)
    assert torch.equal(results["on"], results["off"])


@torch.no_grad()
def test_the_fixed_shape_passes_compute_the_models_own_logits():
    """Invariance alone would not notice a pass that attends to the wrong keys the same way every
    time (the scratch slot, stale entries): the passes' logits are the model's own, to rounding."""
    model = tiny_llama(hidden=64)
    weights = LeanWeights.of(model)
    weights.fixed_rows, weights.static_keys = True, 100
    tokens = torch.randint(3, 64, (40,), generator=torch.Generator().manual_seed(3))
    decoder = LeanDecoder(weights, device_of(weights))
    logits = torch.cat([decoder.logits(decoder.forward(tokens[:3])),
                        decoder.logits(decoder.forward(tokens[3:4])),
                        decoder.logits(decoder.forward(tokens[4:40]))])
    torch.testing.assert_close(logits, model(tokens[None]).logits[0], atol=1e-4, rtol=1e-4)


@pytest.mark.skipif(not rows.available(), reason=f"row kernels: {rows.unavailable_reason()}")
@torch.no_grad()
def test_bfloat16_is_lean_on_the_row_kernels_where_onednn_cannot_pack_it(monkeypatch):
    """Where oneDNN cannot pack bfloat16 (a CPU with AVX2 and no AVX-512), a bfloat16 Llama runs
    the lean path on the row kernels, invariant, not its own forward: held to AVX2 that way,
    SmolLM2's bfloat16 target ran its own forward and pld's and suffix's greedy outputs parted
    from `ar`'s on 6 of 8 held-out prompts, auto's on 2 (scripts/auto_heldout.py, 2026-11-26)."""
    from verispec.model import lean, lowbit, packed

    refuses = lambda dtype: dtype != torch.bfloat16  # noqa: E731 (oneDNN on an AVX2 CPU)
    for module in (packed, lean, lowbit):
        monkeypatch.setattr(module, "cpu_packs", refuses)
    model = tiny_llama(hidden=64).to(torch.bfloat16)
    assert not packed.can_pack(model) and lean.lean_supported(model)
    target = CachedModel(model)
    assert target.invariance == "row-attention" and isinstance(target.lean.weights.head, rows.DenseProduct)
    tokens = torch.randint(3, 64, (PREFIX + 17,), generator=torch.Generator().manual_seed(0))
    assert blocks_differing(target.lean.weights, tokens, invariant=True) == []
