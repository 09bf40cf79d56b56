"""CachedModel: the lean path and the packed view give the model's own logits; padding, rewinding
and compacting a tree's path change neither the cache length nor the logits."""

from __future__ import annotations

import pytest
import torch

from tests.tiny import tiny_foreign, tiny_llama
from verispec.model.cached_model import CachedModel
from verispec.model.lean import lean_supported, rows_take_bfloat16
from verispec.model.packed import PackedLinear, can_pack, cpu_packs, packed_view


def test_padding_is_invisible(target):
    context = torch.arange(5, 25)
    plain, padded = CachedModel(target, pad_to_multiple=1), CachedModel(target, pad_to_multiple=4)
    for lm in (plain, padded):
        lm.forward(context)
    for n in (1, 2, 3, 5, 7):
        block = torch.arange(30, 30 + n)
        expected, got = plain.forward(block), padded.forward(block)
        assert got.shape == expected.shape == (n, target.config.vocab_size)
        assert padded.length == plain.length == len(context) + n
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
        plain.rewind(len(context))
        padded.rewind(len(context))
        assert padded.length == len(context)


def test_lean_path_gives_the_models_own_logits(target):
    lm = CachedModel(target)
    assert lm.lean is not None and lm.runner is None  # a float32 Llama on CPU runs lean
    tokens = torch.arange(3, 40)
    with torch.inference_mode():
        expected = target(input_ids=tokens.unsqueeze(0)).logits[0]
    torch.testing.assert_close(lm.forward(tokens[:30]), expected[:30], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lm.forward(tokens[30:]), expected[30:], rtol=1e-5, atol=1e-5)
    lm.rewind(20)  # rewinding then feeding again overwrites the dropped entries
    torch.testing.assert_close(lm.forward(tokens[20:]), expected[20:], rtol=1e-5, atol=1e-5)
    unpacked = CachedModel(target, pack=False)
    assert unpacked.lean is None and unpacked.runner is target
    torch.testing.assert_close(unpacked.forward(tokens), expected, rtol=1e-5, atol=1e-5)


def test_lean_cache_grows_past_its_first_capacity():
    model = tiny_llama(seed=4)
    tokens = torch.randint(3, 64, (300,), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        expected = model(input_ids=tokens.unsqueeze(0)).logits[0]
    lm = CachedModel(model)
    got = torch.cat([lm.forward(tokens[:100]), lm.forward(tokens[100:])])  # 256 slots at first
    assert lm.length == 300
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("build", [tiny_llama, tiny_foreign], ids=["lean", "hugging-face"])
def test_keeping_a_tree_path_equals_feeding_it(build):
    """After a tree block, keep() leaves the cache exactly as if the kept path had been fed
    (with a context long enough that the lean cache grew during a forward)."""
    model = build(seed=2)
    context, block = torch.arange(300) % 60 + 3, torch.tensor([30, 31, 32, 33, 34, 35])
    parents = torch.tensor([-1, -1, 0, 1, 3])  # root, then two branches: kept path rows 2, 4, 5
    tree, fed = CachedModel(model), CachedModel(model)
    tree.forward(context)
    fed.forward(context)
    tree.forward_hidden(block, parents)
    tree.keep(len(context), [0, 2, 4, 5])
    fed.forward(block[[0, 2, 4, 5]])
    assert tree.length == fed.length == len(context) + 4
    after = torch.tensor([40, 41])
    torch.testing.assert_close(tree.forward(after), fed.forward(after), rtol=1e-5, atol=1e-5)


def test_lean_path_takes_its_families_only():
    assert lean_supported(tiny_llama(seed=1))
    assert not lean_supported(tiny_foreign(seed=1))  # OLMo 2: no lean family
    assert not lean_supported(tiny_llama(seed=1).to(torch.float16))  # cannot be prepacked
    foreign = CachedModel(tiny_foreign(seed=1))
    assert foreign.lean is None and any(isinstance(m, PackedLinear) for m in foreign.runner.modules())


def test_packed_view_gives_the_models_own_logits():
    model = tiny_foreign(seed=8)
    view = packed_view(model)
    assert any(isinstance(m, PackedLinear) for m in view.modules())
    assert not any(isinstance(m, PackedLinear) for m in model.modules())  # the original is untouched
    tokens = torch.arange(3, 40)
    with torch.inference_mode():
        expected = model(input_ids=tokens.unsqueeze(0)).logits[0]
    torch.testing.assert_close(CachedModel(model).forward(tokens), expected, rtol=1e-5, atol=1e-5)


def test_packed_weights_are_shared_and_follow_weight_changes():
    for build, packed_of in ((tiny_foreign, lambda lm: lm.runner), (tiny_llama, lambda lm: lm.lean.weights)):
        model = build(seed=5)
        first, second = CachedModel(model), CachedModel(model)
        assert packed_of(first) is packed_of(second)  # one packed copy per model, not per engine
        with torch.no_grad():
            model.lm_head.weight.mul_(2)  # an in-place update must not leave a stale copy
        third = CachedModel(model)
        assert packed_of(third) is not packed_of(first)
        tokens = torch.arange(3, 20)
        with torch.inference_mode():
            expected = model(input_ids=tokens.unsqueeze(0)).logits[0]
        torch.testing.assert_close(third.forward(tokens), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_rows_do_not_depend_on_the_block(dtype):
    if not cpu_packs(dtype):
        pytest.skip(f"this CPU cannot pack {dtype} weights (oneDNN needs AVX512BW/VL/DQ for bfloat16)")
    generator = torch.Generator().manual_seed(0)
    linear = torch.nn.Linear(64, 96, dtype=dtype)
    packed = PackedLinear(linear)
    rows = torch.randn(16, 64, generator=generator).to(dtype)
    with torch.inference_mode():
        block = packed(rows)
        torch.testing.assert_close(block, linear(rows), rtol=2e-2, atol=2e-2)
        for n in (1, 3, 8):
            assert torch.equal(packed(rows[:n]), block[:n])  # bit for bit


def test_a_model_that_cannot_pack_runs_as_it_is():
    model = tiny_llama(seed=6).to(torch.float16)  # oneDNN packing takes float32 and bfloat16 only
    assert not can_pack(model)
    assert packed_view(model) is model and CachedModel(model).runner is model


def test_a_dtype_this_cpu_cannot_pack_runs_unpacked():
    """bfloat16 where oneDNN cannot pack it (an AVX2 CPU): the lean path on the row kernels where
    they take every product (lean.rows_take_bfloat16), else the model as it is."""
    model = tiny_llama(seed=6).to(torch.bfloat16)
    assert can_pack(model) == cpu_packs(torch.bfloat16)  # probed once: packing a small weight
    lm = CachedModel(model)
    assert (lm.lean is not None) == (cpu_packs(torch.bfloat16) or rows_take_bfloat16(model))
    assert lm.lean is not None or lm.runner is model
    assert lm.forward(torch.tensor([1, 2, 3])).shape == (3, 64)  # runs either way


def test_packed_eagle_network_computes_what_the_plain_one_does(target):
    from verispec.drafters.eagle import EagleNet, eagle_settings

    torch.manual_seed(0)
    net = EagleNet(**eagle_settings(target)).eval()
    view = packed_view(net)
    assert view is not net and any(isinstance(m, PackedLinear) for m in view.modules())
    size = eagle_settings(target)["hidden"]
    embeds, hidden = torch.randn(1, 6, size), torch.randn(1, 6, size)
    with torch.inference_mode():
        expected = net(embeds, hidden, torch.arange(6))
        torch.testing.assert_close(view(embeds, hidden, torch.arange(6)), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("build", [tiny_llama, tiny_foreign], ids=["lean", "hugging-face"])
def test_prefill_and_last_row_read_only_what_they_return(build):
    model = build(seed=9)
    tokens = torch.arange(3, 30)
    full = CachedModel(model)
    logits, hidden = full.forward_hidden(tokens)
    prefilled, last = CachedModel(model), CachedModel(model)
    torch.testing.assert_close(prefilled.prefill(tokens), hidden, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(last.forward_last(tokens), logits[-1], rtol=1e-5, atol=1e-5)
    assert prefilled.length == last.length == len(tokens)
