"""CachedModel: padding multi-token blocks changes neither the cache length nor the logits."""

from __future__ import annotations

import torch

from verispec.cached_model import CachedModel


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


def test_transposed_head_gives_the_models_own_logits(target):
    lm = CachedModel(target)
    assert lm.head_t is not None  # a Llama on CPU takes the fast path
    tokens = torch.arange(3, 40)
    with torch.inference_mode():
        expected = target(input_ids=tokens.unsqueeze(0)).logits[0]
    torch.testing.assert_close(lm.forward(tokens), expected, rtol=1e-5, atol=1e-5)


def test_transposed_head_is_shared_and_follows_weight_changes():
    from tests.tiny import tiny_llama

    model = tiny_llama(seed=5)
    first, second = CachedModel(model), CachedModel(model)
    assert first.head_t is second.head_t  # one copy per weight, not per engine
    with torch.no_grad():
        model.lm_head.weight.mul_(2)  # an in-place update must not leave a stale copy
    third = CachedModel(model)
    assert third.head_t is not first.head_t
    torch.testing.assert_close(third.head_t, model.lm_head.weight.t())
