"""A growable KV cache for one attention layer of one sequence (verispec.model.lean, EAGLE's layer)."""

from __future__ import annotations

import torch

from verispec.core.errors import VerispecError


class KVCache:
    """Keys and values written into preallocated buffers (doubling when full) rather than
    concatenated, which would copy the whole cache at every token; rewound by moving the length
    back. The buffers are made inside a forward, so under inference mode: every in-place update
    runs under it too."""

    def __init__(self) -> None:
        self.keys: torch.Tensor | None = None  # [batch, heads, capacity, head_dim]: batch 1 but in MTP
        self.values: torch.Tensor | None = None
        self.length = 0
        self.fixed = False  # buffers allocated once (`reserve`) and never moved: CUDA graphs read them

    @torch.inference_mode()
    def reserve(self, heads: int, capacity: int, head_dim: int, dtype: torch.dtype,
                device: torch.device) -> None:
        """Allocate zeroed buffers of exactly `capacity` entries that never move or grow (a pass
        captured as a CUDA graph reads them by address; zeros: a masked entry is never NaN)."""
        self.keys, self.values = (torch.zeros(1, heads, capacity, head_dim, dtype=dtype, device=device)
                                  for _ in range(2))
        self.length = 0
        self.fixed = True

    @torch.inference_mode()
    def append(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """keys, values: [1, heads, n, head_dim] -> all cached keys, values [1, heads, length, head_dim]."""
        self.write(keys, values)
        return self.filled()

    def filled(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The cached keys and values: [1, heads, length, head_dim] each."""
        return self.keys[:, :, : self.length], self.values[:, :, : self.length]

    def write(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """`append` without its result or its inference-mode context, for a caller already under
        inference mode (the lean forward, once a layer: entering the context costs ~2 us)."""
        start = self.claim(keys.shape[2], keys.shape[0], keys.shape[1], keys.shape[3], keys)
        self.keys[:, :, start: self.length] = keys
        self.values[:, :, start: self.length] = values

    def claim(self, n: int, batch: int, heads: int, head_dim: int, like: torch.Tensor) -> int:
        """The next n entries, counted as cached, for a caller that fills them itself
        (`rows.heads_into_cache` writes rotated keys straight into the buffers): returns the first's
        index. The buffers are [batch, heads, capacity, head_dim], grown by doubling (the cached
        entries kept) in the dtype and on the device of `like`; under inference mode, as `write`."""
        start, end = self.length, self.length + n
        if self.keys is None or end > self.keys.shape[2]:
            if self.fixed:
                raise VerispecError(f"the sequence ({end} tokens) outgrows its fixed KV cache of "
                                    f"{self.keys.shape[2]} entries", field="max_new_tokens")
            capacity = max(256, 2 * end)
            grown = [like.new_empty(batch, heads, capacity, head_dim) for _ in range(2)]
            if self.keys is not None:
                grown[0][:, :, :start] = self.keys[:, :, :start]
                grown[1][:, :, :start] = self.values[:, :, :start]
            self.keys, self.values = grown
        self.length = end
        return start

    def rewind(self, length: int) -> None:
        self.length = min(self.length, length)

    @torch.inference_mode()
    def keep(self, start: int, index: torch.Tensor) -> None:
        """Keep the first `start` entries, then the entries at `index` [m] (each >= start), in order."""
        end = start + index.shape[0]
        self.keys[:, :, start:end] = self.keys[:, :, index]  # the gather copies before writing
        self.values[:, :, start:end] = self.values[:, :, index]
        self.length = end
