"""The lean path on every family it runs (verispec.model.lean.FAMILIES), on tiny models the tests
build (tests/tiny.py: windows of 6 positions, random norms and biases): its forward is the
family's own Hugging Face forward to float tolerance; it is batch-invariant bitwise in float32,
bfloat16 and on the 4-bit target (one token against blocks 2..17, a tree, batch rows of other
lengths); greedy speculation with the methods that need no training gives plain decoding's tokens;
and on Gemma 3 sampling follows the target's law. A model of no family runs its own forward, and
its stats say so."""

from __future__ import annotations

import pytest
import torch

from tests import test_invariance as invariance
from tests.distribution import POWER, assert_follows, exact_marginals, runs_for, sample_runs
from tests.tiny import FAMILY_NAMES, WINDOW, tiny_family, tiny_foreign
from verispec.core.policies import ConstantK, LoadCap
from verispec.core.stopping import StoppingRules
from verispec.core.types import SamplingParams
from verispec.decoding.engine import SpeculativeEngine
from verispec.decoding.sequence import SequenceSpec
from verispec.drafters.ngram import PromptLookupDrafter
from verispec.drafters.self_spec import SelfDrafter, SelfSettings
from verispec.methods import build_engine
from verispec.model.cached_model import CachedModel
from verispec.model.gguf_blocks import stored_types
from verispec.model.kernels import rows
from verispec.model.lean import LeanDecoder, LeanWeights, family_of, lean_supported, windows
from verispec.model.loading import BUILTIN_MODELS, LoadedModel, load_model
from verispec.model.lowbit import int4_target
from verispec.request import encode_prompt

DTYPES = ("float32", "bfloat16", "int4")


def build(name: str, dtype: str, seed: int = 1, vocab: int = 64) -> torch.nn.Module:
    """A tiny model of family `name` in `dtype` (int4: the 4-bit target over it)."""
    model = tiny_family(name, seed=seed, hidden=64, vocab=vocab)
    if dtype == "int4":
        int4_target(model, None)
        return model
    return model.to(getattr(torch, dtype))


@pytest.mark.parametrize("name", FAMILY_NAMES)
def test_each_family_is_described_and_lean(name):
    model = tiny_family(name)
    family = family_of(model)
    assert family is not None and family.name == name and lean_supported(model)
    expected = {"llama": [None] * 3, "mistral": [WINDOW] * 3, "qwen2": [None, WINDOW, WINDOW],
                "qwen3": [None, None, WINDOW], "gemma3": [WINDOW, None, WINDOW]}[name]
    assert windows(family, model.config) == expected


@pytest.mark.parametrize("name", FAMILY_NAMES)
@torch.no_grad()
def test_lean_forward_is_the_familys_own(name):
    """A prompt longer than the window, one-token steps, then a block: the logits of Hugging
    Face's forward over the whole sequence, to float tolerance."""
    model = tiny_family(name, seed=2)
    tokens = torch.randint(3, 64, (32,), generator=torch.Generator().manual_seed(1))
    expected = model(tokens[None]).logits[0]
    decoder = LeanDecoder(LeanWeights.of(model), torch.device("cpu"))
    pieces = [tokens[:12], *tokens[12:20].split(1), tokens[20:]]
    got = torch.cat([decoder.logits(decoder.forward(piece)) for piece in pieces])
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=2e-5)


WINDOWED = [name for name in FAMILY_NAMES if name != "llama"]


@pytest.mark.skipif(not rows.available(), reason=f"row kernels: {rows.unavailable_reason()}")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("name", WINDOWED)
@torch.no_grad()
def test_windowed_layers_attend_through_the_row_kernel(name, dtype, monkeypatch):
    """With heads of 16 the row kernel attends on every layer, sliding windows included (it is
    called with them, here from the Python layer loop; the C++ one is the test below): the lean
    forward is still the family's own (float32), and a block's rows are still a one-token step's
    bits (blocks 2..17 after the prefix, longer than the window)."""
    model = tiny_family(name, seed=2, head_dim=16).to(getattr(torch, dtype))
    weights = LeanWeights(model)
    weights.native = None
    assert weights.row_kernel_attention and any(layer.window for layer in weights.layers)
    windows_seen = []
    attention = rows.attention

    def spy(*args, window=None):
        windows_seen.append(window)
        return attention(*args, window=window)

    monkeypatch.setattr(rows, "attention", spy)
    tokens = torch.randint(3, 64, (invariance.PREFIX + 17,), generator=torch.Generator().manual_seed(1))
    if dtype == "float32":
        expected = model(tokens[None]).logits[0]
        decoder = LeanDecoder(weights, torch.device("cpu"))
        pieces = [tokens[:12], *tokens[12:20].split(1), tokens[20:]]
        got = torch.cat([decoder.logits(decoder.forward(piece)) for piece in pieces])
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=2e-5)
    assert invariance.blocks_differing(weights, tokens, invariant=True) == []
    assert WINDOW in windows_seen


@pytest.mark.skipif(not rows.available(), reason=f"row kernels: {rows.unavailable_reason()}")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", FAMILY_NAMES)
@torch.no_grad()
def test_each_familys_layers_run_in_one_cpp_call_with_the_python_loops_bits(name, dtype):
    """With heads of 16 (the row kernels' attention) every family runs its decoder layers in
    rows.cpp's layer loop (lean.native_layers) in float32, bfloat16 and 4 bits (Qwen2, whose q/k/v
    carry biases, in float32 only: oneDNN adds them): sliding windows, Qwen3's and Gemma 3's
    per-head q/k norms, Gemma 3's sandwich norms, GeGLU and two rotary tables included. Its bits
    are the Python loop's for one-token steps, blocks of 2..17 rows, the states after given
    layers, and a tree the window cuts into."""
    model = tiny_family(name, seed=2, hidden=64, head_dim=16)
    if dtype == "int4":
        int4_target(model, None)
    else:
        model = model.to(getattr(torch, dtype))
    weights = LeanWeights(model)
    if name == "qwen2" and dtype != "float32":
        assert weights.native is None  # q/k/v biases added after a row kernel's product: the Python loop
        return
    if name != "llama":  # windowed layers (Mistral: all) and others, each seeing through a mask of its own
        windows = weights.native.windows
        assert WINDOW in windows and len(windows) == (1 if name == "mistral" else 2)
    if name == "gemma3":
        assert len(weights.native.kinds) == 2  # local and global rotary tables
    invariance.assert_the_cpp_loop_gives_the_python_loops_bits(weights, 64, prompt=invariance.PREFIX + 2)


@pytest.mark.parametrize("name", FAMILY_NAMES)
@torch.no_grad()
def test_4bit_lean_forward_is_its_own_modules(name):
    """The 4-bit target's lean forward (fused norms with the family's weight offset, fused
    products with their biases, bfloat16 prompt layers) against the same QuantLinear modules run
    through Hugging Face's forward: equal up to bfloat16 rounding."""
    model = build(name, "int4", seed=2)
    tokens = torch.randint(3, 64, (24,), generator=torch.Generator().manual_seed(1))
    expected = model(tokens[None]).logits[0]
    decoder = LeanDecoder(LeanWeights.of(model), torch.device("cpu"))
    got = torch.cat([decoder.logits(decoder.forward(tokens[:12])),
                     *[decoder.logits(decoder.forward(t)) for t in tokens[12:].split(1)]])
    assert (got - expected).abs().max() < 0.05 * expected.abs().max()


@pytest.fixture(scope="module", params=[(n, d) for n in FAMILY_NAMES if n != "llama" for d in DTYPES],
                ids=lambda p: f"{p[0]}-{p[1]}")
def weights(request) -> LeanWeights:
    """The lean weights of each family's tiny model in each dtype (the tiny Llama is in
    tests/test_invariance.py)."""
    return LeanWeights.of(build(*request.param))


@pytest.fixture(scope="module")
def tokens() -> torch.Tensor:
    return torch.randint(3, 64, (invariance.PREFIX + 17,), generator=torch.Generator().manual_seed(0))


@torch.no_grad()
def test_blocks_of_every_length_match_one_token_steps(weights, tokens):
    assert invariance.blocks_differing(weights, tokens, invariant=True) == []


def test_tree_nodes_match_their_paths(weights, tokens):
    invariance.test_tree_nodes_match_their_paths(weights, tokens)


def test_batch_rows_match_alone(weights, tokens):
    invariance.test_batch_rows_match_alone(weights, tokens)


@pytest.mark.parametrize("name", [n for n in FAMILY_NAMES if n != "llama"])
@torch.no_grad()
def test_switched_off_float32_blocks_differ(name, tokens):
    """Without the invariance some block lengths round differently: the checks above bite."""
    assert invariance.blocks_differing(LeanWeights.of(build(name, "float32")), tokens, invariant=False) != []


PROMPTS = [[1, 17, 42, 9, 33, 17, 42, 5, 17, 42, 9, 33, 17], [1, 60, 7]]
METHODS = ("pld", "suffix", "lookahead", "self-int4")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", [n for n in FAMILY_NAMES if n != "llama"])
def test_methods_without_training_are_exact_on_each_family(name, dtype):
    """Greedy pld, suffix, lookahead and self-int4 give `ar`'s tokens, and drafts were kept."""
    target = LoadedModel(build(name, dtype, seed=3), None, f"tiny-{name}")
    plain = build_engine(target, "ar")
    assert plain.target.lean is not None
    references = [plain.generate(SequenceSpec(p, StoppingRules.build(40))).token_ids for p in PROMPTS]
    for method in METHODS:
        engine = build_engine(target, method)
        results = [engine.generate(SequenceSpec(p, StoppingRules.build(40))) for p in PROMPTS]
        assert [r.token_ids for r in results] == references, method
        assert sum(step.num_accepted for r in results for step in r.steps) > 0, method


def test_a_model_of_no_family_runs_its_own_forward_and_says_so():
    model = tiny_foreign(seed=1)
    assert family_of(model) is None and not lean_supported(model)
    stats = CachedModel(model).stats()
    assert stats.invariance == "none" and "Hugging Face forward" in stats.kernel


V = 16
PROMPT = [1, 5, 9, 1, 1, 5, 9]


@pytest.mark.slow  # 11 s on the AVX2 EPYC: sampled at TV 0.1 in the slow checks
@pytest.mark.parametrize("skew", POWER)
def test_sampling_on_gemma3_follows_the_targets_law(skew):
    """Staged int4 self drafting on a tiny Gemma 3 (windows, sandwich norms, GeGLU): the first
    three sampled tokens follow the target's exact law (its own forward), with power against
    `skew` (tests/distribution.py)."""
    model = tiny_family("gemma3", seed=2, vocab=V, hidden=64)
    loaded = LoadedModel(model, None, "tiny-gemma3")

    def make():
        return SelfDrafter(loaded, SelfSettings("int4", skip=(2,)), lookup=PromptLookupDrafter(3, 1))

    engine = SpeculativeEngine(model, make(), ConstantK(3), spawn=make, load_cap=LoadCap(()))
    assert engine.target.lean is not None
    sampling = SamplingParams(do_sample=True, temperature=0.8)
    exact = exact_marginals(model, PROMPT, 3, sampling)
    sampled = sample_runs(engine, PROMPT, 3, sampling, runs_for(exact, skew))
    sampled.check_drafting(positions=2)
    assert_follows(sampled, exact, "gemma3", skew)


# ---- the built-in Gemma 3 270M (the `gemma` extra; slow) -------------------------------------

GEMMA = "gemma3-270m"
GEMMA_PROMPTS = ["The history of the printing press begins", "Question: Why is the sky blue?\nAnswer:"]


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "gguf"])
def test_builtin_gemma3_runs_lean_and_every_method_is_exact(dtype):
    """Gemma 3 270M runs lean (as stored: each tensor in its file's type, Q5_0 81, Q4_K 27,
    Q8_0 10 with the head, Q6_K 9), and greedy pld, suffix, lookahead and self-int4 give `ar`'s
    tokens on it."""
    pytest.importorskip(BUILTIN_MODELS[GEMMA].package, reason="the gemma extra is not installed")
    target = load_model(GEMMA, dtype)
    stats = CachedModel(target.model).stats()
    assert stats.path == "lean (gemma3)" and stats.invariance == "row-attention"
    if dtype == "gguf":
        assert stored_types(target.model) == {"Q5_0": 81, "Q4_K": 27, "Q8_0": 10, "Q6_K": 9}
        assert stats.dtype == "gguf" and "Q4_K:" in stats.kernel
    prompts = [encode_prompt(target, text) for text in GEMMA_PROMPTS]
    plain = build_engine(target, "ar")
    references = [plain.generate(SequenceSpec(p, StoppingRules.build(24))).token_ids for p in prompts]
    for method in METHODS:
        engine = build_engine(target, method)
        assert [engine.generate(
            SequenceSpec(p, StoppingRules.build(24))).token_ids for p in prompts] == references, method
