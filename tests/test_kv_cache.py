"""KVCache: entries written or claimed survive the buffers' growth; a fixed cache refuses to grow."""

import pytest
import torch

from verispec.core.errors import VerispecError
from verispec.model.kv_cache import KVCache


@torch.inference_mode()
def test_claimed_and_written_entries_survive_growth_in_order():
    cache = KVCache()
    written = []
    for step, n in enumerate([200, 1, 70, 300]):  # grows past 256 and again past 2 * 271
        block = torch.full((1, 2, n, 4), float(step)) + torch.arange(n).view(1, 1, n, 1) / 1000
        if step % 2:  # the caller fills what it claims (as rows.heads_into_cache does)
            start = cache.claim(n, 1, 2, 4, block)
            assert start == sum(b.shape[2] for b in written)
            cache.keys[:, :, start: start + n] = block
            cache.values[:, :, start: start + n] = -block
        else:
            cache.write(block, -block)
        written.append(block)
    expected = torch.cat(written, dim=2)  # [1, 2, 571, 4]
    keys, values = cache.filled()
    assert cache.length == 571 and cache.keys.shape[2] >= 571
    assert torch.equal(keys, expected) and torch.equal(values, -expected)


@torch.inference_mode()
def test_a_fixed_cache_refuses_to_grow_and_keeps_its_length():
    cache = KVCache()
    cache.reserve(heads=2, capacity=8, head_dim=4, dtype=torch.float32, device=torch.device("cpu"))
    cache.write(torch.ones(1, 2, 6, 4), torch.ones(1, 2, 6, 4))
    with pytest.raises(VerispecError, match="outgrows its fixed KV cache of 8"):
        cache.claim(3, 1, 2, 4, cache.keys)
    assert cache.length == 6
