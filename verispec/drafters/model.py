"""An independent draft model (SpS): a smaller causal LM with the target's tokenizer."""

from __future__ import annotations

import torch
from transformers import PreTrainedModel

from verispec.cached_model import CachedModel
from verispec.drafters.base import DraftRequest
from verispec.errors import VerispecError
from verispec.sampling import sample, warp_probs
from verispec.tree import TreeSettings
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
    `confidence_threshold`, as Hugging Face's `assistant_confidence_threshold` does. With `tree`
    settings it branches at the first position instead: the top `tree.topk` first tokens, each
    continued greedily, all branches advanced together in one forward per level, to depth k or
    as deep as `tree.nodes` nodes allow (topk * depth <= nodes; at least depth 1).
    """

    def __init__(self, model: PreTrainedModel, vocab_size: int,
                 confidence_threshold: float | None = None, tree: TreeSettings | None = None) -> None:
        if confidence_threshold is not None and not 0 <= confidence_threshold <= 1:
            raise VerispecError(
                f"confidence threshold must be in [0, 1], got {confidence_threshold}")
        self.lm = CachedModel(model)
        self.vocab_size = vocab_size  # the target's logits width
        self.confidence_threshold = confidence_threshold
        self.tree = tree
        self._context_length = 0

    def reset(self) -> None:
        self.lm.reset()
        self._context_length = 0

    def _fit_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [..., vocab_d] -> [..., vocab_t]: padded ids of either model get no draft mass."""
        width = logits.shape[-1]
        if width > self.vocab_size:
            return logits[..., : self.vocab_size]
        if width < self.vocab_size:
            return torch.nn.functional.pad(logits, (0, self.vocab_size - width), value=float("-inf"))
        return logits

    def propose(self, request: DraftRequest) -> Proposal:
        tokens, sampling = request.tokens, request.sampling
        self._context_length = tokens.shape[0]
        logits = self.lm.forward_last(tokens[self.lm.length:])  # the cache always lags by >= 1
        if self.tree is not None:
            width = min(self.tree.topk, self.vocab_size)
            depth = max(1, min(request.k, self.tree.nodes // width))
            return self._propose_tree(self._fit_vocab(logits), width, depth)
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
                logits = self.lm.forward_last(token.view(1))
        return Proposal(torch.stack(drafted), torch.stack(probs) if probs else None)

    def _propose_tree(self, logits: torch.Tensor, width: int, depth: int) -> Proposal:
        """Branches of greedy drafts from the top first tokens; logits [vocab] at the root.

        Deterministic (q one-hot per node) under sampling too. Level d holds node d * b + j of
        branch j; each node sees the context, its own branch and itself.
        """
        levels = [logits.topk(width).indices]  # [b] each
        context = self.lm.length  # the committed tokens, the root included
        device = logits.device
        branch = torch.arange(width, device=device)
        for d in range(1, depth):  # feed level d (depth d) to get level d + 1
            fed = torch.arange((d - 1) * width, device=device) % width  # branch of each fed node
            mask = torch.cat([torch.ones(width, context, dtype=torch.bool, device=device),
                              fed[None, :] == branch[:, None],
                              torch.eye(width, dtype=torch.bool, device=device)], dim=1)
            positions = torch.full((width,), context + d - 1, device=device)
            level_logits = self.lm.forward_masked(levels[-1], mask, positions)  # [b, vocab]
            levels.append(self._fit_vocab(level_logits).argmax(-1))
        tokens = torch.cat(levels)  # [depth * b], level by level
        parents = (torch.arange(tokens.shape[0], device=device) - width).clamp_min(-1)
        return Proposal(tokens, parents=parents)

    def commit(self, num_accepted: int) -> None:
        if self.tree is not None:  # tree nodes are dropped; accepted tokens are re-fed next time
            self.lm.rewind(self._context_length)
            return
        # The cache holds the context plus all drafts but the last; accepted ones stay valid.
        self.lm.rewind(min(self.lm.length, self._context_length + num_accepted))
