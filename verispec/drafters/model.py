"""An independent draft model (SpS): a smaller causal LM with the target's tokenizer."""

from __future__ import annotations

import torch
from transformers import PreTrainedModel

from verispec.cached_model import CachedModel
from verispec.drafters.base import DraftRequest
from verispec.errors import VerispecError
from verispec.sampling import sample, warp_probs
from verispec.types import Proposal


def check_same_vocabulary(target_tokenizer, draft_tokenizer) -> None:
    """Raise unless both tokenizers map the same strings to the same ids."""
    if target_tokenizer is None or draft_tokenizer is None:
        return
    target_vocab, draft_vocab = target_tokenizer.get_vocab(), draft_tokenizer.get_vocab()
    if len(target_vocab) != len(draft_vocab):
        raise VerispecError(
            f"draft vocabulary has {len(draft_vocab)} tokens, the target's {len(target_vocab)}: "
            "a draft model must share the target's tokenizer")
    differing = [t for t, i in target_vocab.items() if draft_vocab.get(t) != i]
    if differing:
        raise VerispecError(
            f"draft and target tokenizers differ on {len(differing)} tokens (e.g. {differing[0]!r}): "
            "a draft model must share the target's tokenizer")


class ModelDrafter:
    """Drafts autoregressively with its own KV cache.

    Stops early when its confidence (its probability of the token it just drafted) falls below
    `confidence_threshold`, as Hugging Face's `assistant_confidence_threshold` does.
    """

    def __init__(self, model: PreTrainedModel, vocab_size: int,
                 confidence_threshold: float | None = None) -> None:
        if confidence_threshold is not None and not 0 <= confidence_threshold <= 1:
            raise VerispecError(
                f"confidence threshold must be in [0, 1], got {confidence_threshold}")
        self.lm = CachedModel(model)
        self.vocab_size = vocab_size  # the target's logits width
        self.confidence_threshold = confidence_threshold
        self._context_length = 0

    def reset(self) -> None:
        self.lm.reset()
        self._context_length = 0

    def _fit_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [vocab_d] -> [vocab_t]: padded ids of either model get no draft mass."""
        width = logits.shape[-1]
        if width > self.vocab_size:
            return logits[: self.vocab_size]
        if width < self.vocab_size:
            return torch.nn.functional.pad(logits, (0, self.vocab_size - width), value=float("-inf"))
        return logits

    def propose(self, request: DraftRequest) -> Proposal:
        tokens, sampling = request.tokens, request.sampling
        self._context_length = tokens.shape[0]
        logits = self.lm.forward(tokens[self.lm.length:])[-1]  # the cache always lags by >= 1
        drafted, probs = [], []
        for i in range(request.k):
            logits = self._fit_vocab(logits)
            if sampling.greedy:
                token = logits.argmax(-1)
            else:
                q = warp_probs(logits, sampling)  # [vocab]
                token = sample(q, request.generator)
                probs.append(q)
            drafted.append(token)
            # The threshold check reads one float per draft token (a host sync), only when set.
            if (self.confidence_threshold is not None
                    and float(logits.softmax(-1)[token]) < self.confidence_threshold):
                break
            if i < request.k - 1:
                logits = self.lm.forward(token.view(1))[-1]
        return Proposal(torch.stack(drafted), torch.stack(probs) if probs else None)

    def commit(self, num_accepted: int) -> None:
        # The cache holds the context plus all drafts but the last; accepted ones stay valid.
        self.lm.rewind(min(self.lm.length, self._context_length + num_accepted))
