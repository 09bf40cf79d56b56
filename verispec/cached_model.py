"""A Hugging Face causal LM with its own KV cache that can be advanced and rewound.

The engine holds one for the target; model-based drafters hold their own. Batch size is 1.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache, PreTrainedModel


class CachedModel:
    """Feeds tokens through `model`, keeping their keys and values; `rewind` drops the newest."""

    def __init__(self, model: PreTrainedModel) -> None:
        self.model = model
        self.cache = DynamicCache(config=model.config)

    @property
    def length(self) -> int:
        """Number of tokens whose keys and values are cached."""
        return self.cache.get_seq_length()

    @property
    def device(self) -> torch.device:
        return self.model.device

    def reset(self) -> None:
        self.cache = DynamicCache(config=self.model.config)

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Append tokens [n] to the cache; return logits [n, vocab] (float32)."""
        out = self.model(input_ids=tokens.unsqueeze(0), past_key_values=self.cache, use_cache=True)
        return out.logits[0].float()

    def rewind(self, length: int) -> None:
        """Keep only the first `length` cached tokens."""
        drop = self.length - length
        if drop > 0:
            self.cache.crop(-drop)
