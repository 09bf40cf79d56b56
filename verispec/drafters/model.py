"""An independent draft model (SpS): a smaller causal LM with the target's tokenizer."""

from __future__ import annotations

from dataclasses import replace

import torch
from transformers import PreTrainedModel

from verispec.cached_model import CachedModel
from verispec.drafters.base import Drafter, DraftRequest
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

    With a `lookup` drafter it drafts in stages (Spector & Re 2023): the lookup's guesses for the
    next tokens go through this drafter in one multi-token forward, which keeps the guesses it
    agrees with (greedy: its argmax; sampling: accepts a guess x with probability q(x), else
    draws from q without x, so every token is still distributed as q) and drafts on from there.
    A lookup that matches saves most of this drafter's one-token forwards.
    """

    def __init__(self, model: PreTrainedModel | CachedModel, vocab_size: int,
                 confidence_threshold: float | None = None, tree: TreeSettings | None = None,
                 lookup: Drafter | None = None) -> None:
        """model: the draft model, or a CachedModel already set up to run it."""
        if confidence_threshold is not None and not 0 <= confidence_threshold <= 1:
            raise VerispecError(
                f"confidence threshold must be in [0, 1], got {confidence_threshold}")
        if tree is not None and lookup is not None:
            raise VerispecError("staged drafting (a lookup before the draft model) drafts chains only")
        self.lm = model if isinstance(model, CachedModel) else CachedModel(model)
        self.vocab_size = vocab_size  # the target's logits width
        self.confidence_threshold = confidence_threshold
        self.tree = tree
        self.lookup = lookup
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
        tokens = request.tokens
        self._context_length = tokens.shape[0]
        fed = tokens[self.lm.length:]  # the cache always lags by >= 1
        if self.tree is not None:
            logits = self.lm.forward_last(fed)
            width = min(self.tree.topk, self.vocab_size)
            depth = max(1, min(request.k, self.tree.nodes // width))
            return self._propose_tree(self._fit_vocab(logits), width, depth)
        guesses = self._guesses(request)
        if guesses.shape[0]:
            logits = self.lm.forward_tail(torch.cat([fed, guesses]), guesses.shape[0] + 1)
            drafted, probs, logits = self._check_guesses(self._fit_vocab(logits), guesses, request)
            # The cache keeps the guesses this drafter agreed with; the last token is not fed yet.
            self.lm.rewind(self._context_length + len(drafted) - 1)
        else:
            logits = self._fit_vocab(self.lm.forward_last(fed))
            drafted, probs = self._draft_one(logits, request)
        while len(drafted) < request.k and not self._unsure(logits, drafted[-1]):
            logits = self._fit_vocab(self.lm.forward_last(drafted[-1].view(1)))
            token, q = self._draft_one(logits, request)
            drafted += token
            probs += q
        return Proposal(torch.stack(drafted), torch.stack(probs) if probs else None)

    def _guesses(self, request: DraftRequest) -> torch.Tensor:
        """The lookup's guesses for the next k - 1 tokens ([m], m may be 0): the draft model
        always adds one token of its own after the guesses it keeps."""
        if self.lookup is None or request.k < 2:
            return request.tokens[:0]
        return self.lookup.propose(replace(request, k=request.k - 1)).tokens

    @staticmethod
    def _draft_one(logits: torch.Tensor, request: DraftRequest
                   ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """One draft token from logits [vocab]: ([token], [q]) (no q under greedy: one-hot)."""
        if request.sampling.greedy:
            return [logits.argmax(-1)], []
        q = warp_probs(logits, request.sampling)  # [vocab]
        return [sample(q, request.generator)], [q]

    def _unsure(self, logits: torch.Tensor, token: torch.Tensor) -> bool:
        """Whether confidence in `token`, drafted from logits [vocab], is below the threshold.
        Reads one float per draft token (a host sync), only when a threshold is set."""
        return (self.confidence_threshold is not None
                and float(logits.softmax(-1)[token]) < self.confidence_threshold)

    @staticmethod
    def _check_guesses(logits: torch.Tensor, guesses: torch.Tensor, request: DraftRequest
                       ) -> tuple[list[torch.Tensor], list[torch.Tensor], torch.Tensor]:
        """Keep the guesses [m] this drafter agrees with, then add its own next token. Returns
        the drafted tokens, their q (none under greedy) and the logits [vocab] of the last one.

        logits: [m + 1, vocab]; row i is this drafter's prediction after guesses[:i]. Greedy: the
        guesses up to the first that is not the argmax, then the argmax there. Sampling: guess x
        at row i is kept with probability q_i(x); a rejected guess is replaced by a draw from q_i
        without x, which leaves every drafted token distributed exactly as q_i.
        Example (greedy): guesses [5, 6, 7], argmax per row [5, 6, 9, 2] -> [5, 6, 9].
        """
        m = guesses.shape[0]
        if request.sampling.greedy:
            choices = logits.argmax(-1)  # [m + 1]
            agreed = int((choices[:m] == guesses).cumprod(0).sum())
            return list(guesses[:agreed]) + [choices[agreed]], [], logits[agreed]
        drafted, probs = [], []
        q = warp_probs(logits, request.sampling)  # [m + 1, vocab]
        for i in range(m + 1):
            probs.append(q[i])
            if i == m:
                drafted.append(sample(q[i], request.generator))
                break
            guess = guesses[i]
            if torch.rand((), generator=request.generator, device=q.device) < q[i, guess]:
                drafted.append(guess)
                continue
            drafted.append(sample(q[i].index_fill(0, guess.view(1), 0.0), request.generator))
            break
        return drafted, probs, logits[len(drafted) - 1]

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
