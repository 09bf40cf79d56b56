"""CachedModel: padding multi-token blocks changes neither the cache length nor the logits."""

from __future__ import annotations

import pytest
import torch

from verispec.cached_model import CachedModel
from verispec.packed import PackedLinear, can_pack, cpu_packs, packed_view


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


def test_packed_view_gives_the_models_own_logits(target):
    lm = CachedModel(target)
    assert lm.runner is not target  # a float32 model on CPU runs prepacked
    assert any(isinstance(m, PackedLinear) for m in lm.runner.modules())
    assert not any(isinstance(m, PackedLinear) for m in target.modules())  # the original is untouched
    tokens = torch.arange(3, 40)
    with torch.inference_mode():
        expected = target(input_ids=tokens.unsqueeze(0)).logits[0]
    torch.testing.assert_close(lm.forward(tokens), expected, rtol=1e-5, atol=1e-5)
    unpacked = CachedModel(target, pack=False)
    assert unpacked.runner is target
    torch.testing.assert_close(unpacked.forward(tokens), expected, rtol=1e-5, atol=1e-5)


def test_packed_view_is_shared_and_follows_weight_changes():
    from tests.tiny import tiny_llama

    model = tiny_llama(seed=5)
    first, second = CachedModel(model), CachedModel(model)
    assert first.runner is second.runner  # one packed copy per model, not per engine
    with torch.no_grad():
        model.lm_head.weight.mul_(2)  # an in-place update must not leave a stale copy
    third = CachedModel(model)
    assert third.runner is not first.runner
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
    from tests.tiny import tiny_llama

    model = tiny_llama(seed=6).to(torch.float16)  # oneDNN packing takes float32 and bfloat16 only
    assert not can_pack(model)
    assert packed_view(model) is model and CachedModel(model).runner is model


def test_a_dtype_this_cpu_cannot_pack_runs_unpacked():
    from tests.tiny import tiny_llama

    model = tiny_llama(seed=6).to(torch.bfloat16)
    assert can_pack(model) == cpu_packs(torch.bfloat16)  # probed once: packing a small weight
    runner = CachedModel(model).runner
    assert (runner is not model) == cpu_packs(torch.bfloat16)
    with torch.inference_mode():
        runner(input_ids=torch.tensor([[1, 2, 3]]))  # runs either way


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
