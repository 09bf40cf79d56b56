"""Self-speculation in low precision: weight formats, kernels, GGUF blocks, exactness."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize

from tests.tiny import VOCAB, plain_greedy, tiny_foreign, tiny_llama, tiny_loaded
from verispec.core.errors import VerispecError
from verispec.core.sampling import warp_probs
from verispec.core.stopping import StoppingRules
from verispec.core.tree import TreeSettings
from verispec.core.types import SamplingParams
from verispec.decoding.sequence import SequenceSpec
from verispec.drafters.base import DraftRequest
from verispec.drafters.model import ModelDrafter
from verispec.drafters.self_spec import SelfDrafter, SelfSettings
from verispec.methods import build_engine
from verispec.model.kernels import rows
from verispec.model.loading import LoadedModel
from verispec.model.lowbit import (
    Int4Groups,
    Int4Kernel,
    Int8Channels,
    RescoredHead,
    candidates,
    choose_kernel,
    llama_q_k_rows,
    q4_blocks,
    quantize,
)
from verispec.options import DraftOptions

NEW = 40
PROMPTS = [[1, 17, 42, 9, 33, 17, 42, 5, 17, 42], [1, 60]]


@pytest.fixture(scope="module")
def loaded():
    return tiny_loaded()


@pytest.fixture(scope="module")
def references(loaded):
    return [plain_greedy(loaded.model, p, NEW) for p in PROMPTS]


# ---- formats and kernels --------------------------------------------------------------------


@pytest.mark.parametrize("group", [32, 64, 128])
def test_int4_groups_round_to_the_nearest_code(group):
    weight = torch.randn(48, 256, generator=torch.Generator().manual_seed(0))
    stored = Int4Groups.quantize(weight, group)
    assert stored.group == group and stored.codes.dtype == torch.uint8 and int(stored.codes.max()) <= 15
    error = (stored.dequantize() - weight).abs().reshape(48, 256 // group, group)
    assert (error <= stored.scales[..., None] / 2 + 1e-6).all()  # within half a step of its group


def test_int8_channels_round_to_the_nearest_code():
    weight = torch.randn(32, 64, generator=torch.Generator().manual_seed(1))
    stored = Int8Channels.quantize(weight)
    assert (stored.codes.abs() <= 127).all()
    assert ((stored.dequantize() - weight).abs() <= stored.scales[:, None] / 2 + 1e-6).all()


@pytest.mark.parametrize("fmt", ["int4", "int8", "bf16"])
def test_every_kernel_multiplies_by_the_stored_weight(fmt):
    """Each candidate kernel computes x @ w.T for the weight the format stores (to bf16 precision)."""
    generator = torch.Generator().manual_seed(2)
    weight, x = torch.randn(64, 128, generator=generator), torch.randn(5, 128, generator=generator)
    stored = quantize(weight, fmt, 32)
    expected = x @ (stored.float() if fmt == "bf16" else stored.dequantize()).T
    found = candidates(fmt, torch.device("cpu"))
    if rows.available():  # every format has its row kernel among its candidates where they run
        assert f"{fmt}-rows" in found
    for label, build in found.items():
        kernel = build(stored)
        out = kernel(x)
        assert out.shape == (5, 64) and out.dtype == x.dtype, label
        torch.testing.assert_close(out, expected, atol=0.1, rtol=0.02, msg=label)
        assert kernel.nbytes > 0 and kernel.name
    assert choose_kernel(fmt, ((64, 128),)) in candidates(fmt, torch.device("cpu"))



def test_the_kernel_choice_is_measured_once_per_machine(monkeypatch, tmp_path):
    """The first load on a machine times the candidates and caches its choice under the cache
    directory; a later process reads it, timing nothing; other threads (or another CPU, torch or
    kernel build: the same key) time again."""
    from verispec.model import lowbit
    from verispec.model.kernels import rows

    monkeypatch.setattr(rows, "cache_dir", lambda: tmp_path)
    timed = []
    fastest = "int4-f32"  # not what this machine would pick: the cached label is what comes back
    monkeypatch.setattr(lowbit, "time_kernels", lambda *args: timed.append(args[:3]) or fastest)
    shapes = ((64, 128), (32, 64))
    choose_kernel.cache_clear()
    try:
        first = choose_kernel("int4", shapes)
        choose_kernel.cache_clear()  # as a new process
        second = choose_kernel("int4", shapes)
        assert first == second == fastest and timed == [("int4", shapes, 32)]
        assert len(list(tmp_path.glob("lowbit-*.json"))) == 1
        choose_kernel.cache_clear()
        monkeypatch.setattr(torch, "get_num_threads", lambda: 7)
        assert choose_kernel("int4", shapes) == fastest and len(timed) == 2
        assert len(list(tmp_path.glob("lowbit-*.json"))) == 2
    finally:
        choose_kernel.cache_clear()

def test_int4_kernel_packs_the_codes_it_was_given():
    """The packed layout, read back through the kernel (x = identity), gives the dequantized
    weights up to the bfloat16 rounding of scales and zeros."""
    stored = Int4Groups.quantize(torch.randn(32, 64, generator=torch.Generator().manual_seed(3)), 32)
    unpacked = Int4Kernel(stored, torch.bfloat16)(torch.eye(64)).T
    torch.testing.assert_close(unpacked, stored.dequantize(), atol=0.03, rtol=0.01)


def test_rescored_head_puts_exact_logits_on_its_top_candidates():
    generator = torch.Generator().manual_seed(4)
    weight, x = torch.randn(256, 32, generator=generator), torch.randn(3, 32, generator=generator)
    approximate = candidates("int4", torch.device("cpu"))["int4-bf16"](Int4Groups.quantize(weight, 32))
    head = RescoredHead(approximate, weight, top=8)
    logits, exact = head(x), x @ weight.T
    top = approximate(x).topk(8, dim=-1).indices
    torch.testing.assert_close(logits.gather(-1, top), exact.gather(-1, top), atol=1e-5, rtol=1e-5)
    assert torch.equal(logits.argmax(-1), exact.argmax(-1))


# ---- GGUF blocks ----------------------------------------------------------------------------


@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1"])
def test_gguf_q4_blocks_are_taken_exactly(qtype):
    """Blocks quantized by gguf-py read back to exactly the values gguf-py (and so transformers)
    dequantizes them to."""
    weight = np.random.default_rng(5).standard_normal((48, 96)).astype(np.float32)
    raw = gguf_quantize(weight, GGMLQuantizationType[qtype])
    stored = q4_blocks(raw, qtype, 48, 96)
    assert stored.group == 32
    expected = torch.from_numpy(gguf_dequantize(raw, GGMLQuantizationType[qtype]))
    assert torch.equal(stored.dequantize(), expected)


def test_q_k_row_order_is_transformers_reverse_permutation():
    """transformers un-permutes GGUF's q/k rows on load (reshape(heads, dim, 2).swapaxes(2, 1));
    our row order does the same to the blocks."""
    rows, heads = 48, 3
    rows_in_gguf = np.arange(rows)
    hf = rows_in_gguf.reshape(heads, rows // heads // 2, 2).swapaxes(2, 1).reshape(rows)
    assert llama_q_k_rows(rows, heads).tolist() == hf.tolist()


# ---- exactness ------------------------------------------------------------------------------


def self_drafters(loaded):
    return {
        "int4": SelfDrafter(loaded, SelfSettings("int4")),
        "int8": SelfDrafter(loaded, SelfSettings("int8")),
        "bf16": SelfDrafter(loaded, SelfSettings("bf16")),
        "int4-skip": SelfDrafter(loaded, SelfSettings("int4", skip=(1,))),
        "int4-tree": SelfDrafter(loaded, SelfSettings("int4"), tree=TreeSettings(3, 24)),
        "int4-staged": SelfDrafter(loaded, SelfSettings("int4"),
                                   lookup=build_engine(loaded, "pld").drafter),
        "int8-target-head": SelfDrafter(loaded, SelfSettings("int8", head="target", rescore=0)),
    }


# k = 1, 3, 8, 16 by default (as tests/test_greedy_equality.py), the others under slow (~3 s each
# on the AVX2 EPYC)
@pytest.mark.parametrize("k", [k if k in (1, 3, 8, 16) else pytest.param(k, marks=pytest.mark.slow)
                               for k in range(1, 17)])
def test_self_drafters_match_plain_decoding(loaded, references, k):
    from verispec.core.policies import ConstantK
    from verispec.decoding.engine import SpeculativeEngine

    for name, drafter in self_drafters(loaded).items():
        engine = SpeculativeEngine(loaded.model, drafter, ConstantK(k))
        for prompt, truth in zip(PROMPTS, references):
            result = engine.generate(SequenceSpec(prompt, StoppingRules.build(NEW)))
            assert result.token_ids == truth, f"self {name} with k={k} diverged from plain decoding"


@pytest.mark.skipif(not rows.available(), reason="the row kernels do not run here")
@pytest.mark.parametrize("fmt", ["int4", "int8", "bf16"])
def test_self_drafters_on_the_row_kernels_match_plain_decoding(loaded, references, fmt, monkeypatch,
                                                                 tmp_path):
    """Each format's drafter with its row kernel chosen (whatever this machine's timing would
    pick on a tiny model) drafts through it, and greedy outputs are plain decoding's."""
    from verispec.core.policies import ConstantK
    from verispec.decoding.engine import SpeculativeEngine
    from verispec.model import lowbit

    monkeypatch.setattr(rows, "cache_dir", lambda: tmp_path)
    monkeypatch.setattr(lowbit, "time_kernels", lambda *args: f"{fmt}-rows")
    choose_kernel.cache_clear()
    try:
        drafter = SelfDrafter(loaded, SelfSettings(fmt, rescore=0))
    finally:
        choose_kernel.cache_clear()
    expected = {"int4": "int4 g32", "int8": "int8 per row", "bf16": "bfloat16"}[fmt]
    assert drafter.weights.names["layers"].startswith(expected) and "verispec rows" in drafter.describe()
    engine = SpeculativeEngine(loaded.model, drafter, ConstantK(4))
    for prompt, truth in zip(PROMPTS, references):
        result = engine.generate(SequenceSpec(prompt, StoppingRules.build(NEW)))
        assert result.token_ids == truth, f"self-{fmt} on the row kernels diverged from plain decoding"
        assert sum(result.stats.drafted_by_position) > 0 and result.stats.target_forwards < NEW


@pytest.mark.parametrize("method", ["self-int4", "self-int8", "self-bf16", "self-int4-pld"])
def test_registered_methods_match_plain_decoding(loaded, references, method):
    engine = build_engine(loaded, method, DraftOptions(k=5))
    for prompt, truth in zip(PROMPTS, references):
        assert engine.generate(SequenceSpec(prompt, StoppingRules.build(NEW))).token_ids == truth
    assert "int" in engine.drafter.describe() or "bf16" in engine.drafter.describe()


def test_staged_drafting_keeps_guesses_and_saves_forwards(loaded):
    """A repetitive context: prompt lookup's guesses are checked in one drafter forward, and the
    drafter keeps them where it agrees (greedy: its argmax)."""
    prompt = [1] + [17, 42, 9, 33, 5] * 6
    plain = SelfDrafter(loaded, SelfSettings("int4"))
    staged = SelfDrafter(loaded, SelfSettings("int4"), lookup=build_engine(loaded, "pld").drafter)
    request = DraftRequest(torch.tensor(prompt), 6, SamplingParams(), None)
    assert torch.equal(plain.propose(request).tokens, staged.propose(request).tokens)


def test_check_guesses_is_exact_under_sampling():
    """Guess x kept with probability q(x), else a draw from q without x: the drafted token at
    every row is distributed as that row's q, whatever the guesses."""
    torch.manual_seed(0)
    vocab, n = 8, 40_000
    logits = torch.randn(3, vocab) * 1.5  # rows: after 0, 1, 2 guesses
    guesses = torch.tensor([int(logits[0].argmax()), int(logits[1].argmin())])
    sampling = SamplingParams(do_sample=True, temperature=1.0)
    q = warp_probs(logits, sampling)
    request = DraftRequest(torch.zeros(1, dtype=torch.int64), 3, sampling, torch.Generator().manual_seed(1))
    first = torch.zeros(vocab)
    second = torch.zeros(vocab)
    for _ in range(n):
        drafted, probs, _ = ModelDrafter._check_guesses(logits, guesses, request)
        first[drafted[0]] += 1
        if int(drafted[0]) == int(guesses[0]):
            assert len(drafted) >= 2 and torch.equal(probs[1], q[1])
            second[drafted[1]] += 1
        else:
            assert len(drafted) == 1
    bound = lambda count: math.sqrt(2 * (vocab * math.log(2) + math.log(1e6)) / count)  # noqa: E731
    assert 0.5 * (first / n - q[0]).abs().sum() < bound(n)
    reached = int(second.sum())
    assert 0.5 * (second / reached - q[1]).abs().sum() < bound(reached)


def test_sampled_self_drafts_report_their_q(loaded):
    sampling = SamplingParams(do_sample=True, temperature=0.8)
    for name, drafter in self_drafters(loaded).items():
        drafter.reset()
        proposal = drafter.propose(DraftRequest(torch.tensor(PROMPTS[0]), 4, sampling,
                                                torch.Generator().manual_seed(0)))
        if name.endswith("tree"):
            assert proposal.draft_probs is None  # chosen by rank: one-hot q
            continue
        q = proposal.draft_probs
        assert q is not None and q.shape == (len(proposal), VOCAB), name
        torch.testing.assert_close(q.sum(-1), torch.ones(len(proposal)))
        assert (q.gather(-1, proposal.tokens[:, None]) > 0).all(), name


# slow: the default suite samples self-int4-pld at power in tests/test_sampling_drafters.py (the same
# drafter classes) and through build_engine in tests/test_bytes.py; this one keeps 6000 samples.
@pytest.mark.slow
def test_sampling_with_self_drafters_emits_the_target_distribution(loaded):
    """End to end, the first two emitted tokens follow the target's distribution (TV against a
    bound from the sample size), drafting with the int4 copy, staged behind lookup."""
    prompt = [1, 17, 42, 9, 17, 42]
    sampling = SamplingParams(do_sample=True, temperature=1.0)
    with torch.no_grad():
        p1 = warp_probs(loaded.model(torch.tensor([prompt])).logits[0, -1], sampling)
        nxt = torch.tensor([prompt + [t] for t in range(VOCAB)])
        p2 = p1 @ warp_probs(loaded.model(nxt).logits[:, -1], sampling)  # marginal of the 2nd token
    engine = build_engine(loaded, "self-int4-pld", DraftOptions(k=3))
    n = 6000
    first, second = torch.zeros(VOCAB), torch.zeros(VOCAB)
    for seed in range(n):
        tokens = engine.generate(SequenceSpec(prompt, StoppingRules.build(2), sampling, seed=seed)).token_ids
        first[tokens[0]] += 1
        second[tokens[1]] += 1
    bound = math.sqrt(2 * (VOCAB * math.log(2) + math.log(1e6)) / n)
    assert 0.5 * (first / n - p1).abs().sum() < bound
    assert 0.5 * (second / n - p2).abs().sum() < bound


# ---- errors and memory ----------------------------------------------------------------------


def test_unsupported_targets_and_settings_are_clear_errors(loaded):
    foreign = LoadedModel(tiny_foreign(seed=1), None, "olmo2")
    with pytest.raises(VerispecError, match="a decoder of a lean family"):
        build_engine(foreign, "self-int4")
    with pytest.raises(VerispecError, match="group size must be one of"):
        build_engine(loaded, "self-int4", DraftOptions(group=48))
    with pytest.raises(VerispecError, match="multiple of it"):
        build_engine(loaded, "self-int4", DraftOptions(group=128))  # the tiny model is 32 wide
    with pytest.raises(VerispecError, match="layers to skip"):
        build_engine(loaded, "self-int4", DraftOptions(skip_layers=(3,)))
    with pytest.raises(VerispecError, match="layers to skip"):
        build_engine(loaded, "self-int4", DraftOptions(skip_layers=(0, 1, 2)))
    with pytest.raises(VerispecError, match="chains only"):
        build_engine(loaded, "self-int4-pld", DraftOptions(tree=TreeSettings(2, 4)))


def test_drafter_weights_are_a_fraction_of_the_target():
    model = tiny_llama(seed=0, layers=2, vocab=256, hidden=128)
    target_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    loaded = LoadedModel(model, None, "tiny-wide")
    for fmt, share in (("int4", 0.30), ("int8", 0.30)):
        weights = SelfDrafter(loaded, SelfSettings(fmt)).weights
        assert weights.nbytes <= share * target_bytes, (fmt, weights.nbytes, target_bytes)


def test_api_and_cli_reach_self_methods(tiny_dir, capsys):
    import json

    from verispec.api import generate
    from verispec.cli import main

    result = generate(str(tiny_dir), [1, 17, 42, 9], method="self-int4-pld", num_assistant_tokens=4,
                      max_new_tokens=12)
    plain = generate(str(tiny_dir), [1, 17, 42, 9], max_new_tokens=12)
    assert result.token_ids == plain.token_ids and result.stats.target_forwards < 12
    with pytest.raises(VerispecError, match="choose one speculation method"):
        generate(str(tiny_dir), [1, 2], method="self-int4", prompt_lookup_num_tokens=3)
    # The CLI's default method is the fastest measured where the model runs it.
    assert main(["generate", "--model", str(tiny_dir), "--prompt", "w5 w6 w5 w6", "--raw",
                 "--max-new-tokens", "8", "--json", "--skip-layers", "1", "--group", "32"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert len(out["token_ids"]) == 8
    with pytest.raises(SystemExit) as bad:
        main(["generate", "--model", str(tiny_dir), "--prompt", "w5", "--skip-layers", "x"])
    assert bad.value.code == 2 and "expected integers" in capsys.readouterr().err


def test_drafter_starts_from_the_targets_prompt_cache(loaded):
    """adopt_prefill copies the target's prompt keys and values instead of recomputing them."""
    from verispec.model.cached_model import CachedModel

    target = CachedModel(loaded.model)
    target.prefill(torch.tensor(PROMPTS[0][:-1]))
    drafter = SelfDrafter(loaded, SelfSettings("int4", skip=(1,)))
    drafter.adopt_prefill(target)
    assert drafter.lm.length == target.length == len(PROMPTS[0]) - 1
    for mine, index in zip(drafter.lm.lean.caches, (0, 2)):  # layer 1 skipped
        theirs = target.lean.caches[index]
        assert torch.equal(mine.keys[:, :, : mine.length], theirs.keys[:, :, : theirs.length])
        assert torch.equal(mine.values[:, :, : mine.length], theirs.values[:, :, : theirs.length])
