"""An independent draft model (SpS): a smaller causal LM with the target's tokenizer."""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

import torch

from verispec.core.argmax import argmax
from verispec.core.errors import VerispecError
from verispec.core.sampling import sample, warp_probs
from verispec.core.tree import TreeSettings
from verispec.core.types import Proposal
from verispec.drafters.base import Drafter, DraftRequest
from verispec.model.cached_model import CachedModel, forward_tails

if TYPE_CHECKING:
    from transformers import PreTrainedModel


def same_vocabulary(target_tokenizer, draft_tokenizer) -> bool:
    """Whether both tokenizers map the same strings to the same ids (or either is unknown: token
    ids given directly are taken to be the target's). Otherwise the draft model drafts through
    verispec.drafters.cross."""
    if target_tokenizer is None or draft_tokenizer is None:
        return True
    return target_tokenizer.get_vocab() == draft_tokenizer.get_vocab()


class ModelDrafter(Drafter):
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

    batches = True
    forks = True

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

    def copy_from(self, other: Drafter) -> None:
        self.lm.copy_from(other.lm)

    def truncate(self, length: int) -> None:
        self.lm.rewind(min(self.lm.length, length))

    def _fit_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [..., vocab_d] -> [..., vocab_t]: padded ids of either model get no draft mass."""
        width = logits.shape[-1]
        if width > self.vocab_size:
            return logits[..., : self.vocab_size]
        if width < self.vocab_size:
            return torch.nn.functional.pad(logits, (0, self.vocab_size - width), value=float("-inf"))
        return logits

    def propose(self, request: DraftRequest) -> Proposal:
        return self.propose_batch([self], [request])[0]

    @staticmethod
    def propose_batch(drafters: list[ModelDrafter], requests: list[DraftRequest]) -> list[Proposal]:
        """Proposals for several sequences of a batch, each from its own drafter (and cache):
        each drafting position is one forward for all of them, one pass where the drafters are
        lean over shared weights (verispec.model.cached_model.forward_tails). Trees draft one sequence
        at a time."""
        proposals = {i: drafter._propose_tree(request) for i, (drafter, request)
                     in enumerate(zip(drafters, requests)) if drafter.tree is not None}
        chains = [i for i in range(len(drafters)) if i not in proposals]
        guesses = {i: drafters[i]._guesses(requests[i]) for i in chains}
        blocks = []
        for i in chains:
            drafter, tokens = drafters[i], requests[i].tokens
            drafter._context_length = tokens.shape[0]
            blocks.append(torch.cat([tokens[drafter.lm.length:], guesses[i]]))  # cache lags >= 1
        firsts = forward_tails([drafters[i].lm for i in chains], blocks,
                               [guesses[i].shape[0] + 1 for i in chains])
        drafted, probs, last = {}, {}, {}  # per sequence: tokens, their q, the last logits [vocab]
        for i, logits in zip(chains, firsts):
            drafter, request, logits = drafters[i], requests[i], drafters[i]._fit_vocab(logits)
            if guesses[i].shape[0]:
                drafted[i], probs[i], last[i] = drafter._check_guesses(logits, guesses[i], request)
                # The cache keeps the guesses this drafter agreed with; the last token is not fed yet.
                drafter.lm.rewind(drafter._context_length + len(drafted[i]) - 1)
            else:
                last[i] = logits[0]
                drafted[i], probs[i] = drafter._draft_one(last[i], request)

        def going(i: int) -> bool:
            return len(drafted[i]) < requests[i].k and not drafters[i]._unsure(last[i], drafted[i][-1])

        active = [i for i in chains if going(i)]
        while active:
            outputs = forward_tails([drafters[i].lm for i in active],
                                    [drafted[i][-1].view(1) for i in active], [1] * len(active))
            for i, logits in zip(active, outputs):
                last[i] = drafters[i]._fit_vocab(logits[0])
                token, q = drafters[i]._draft_one(last[i], requests[i])
                drafted[i] += token
                probs[i] += q
            active = [i for i in active if going(i)]
        for i in chains:
            proposals[i] = Proposal(torch.stack(drafted[i]), torch.stack(probs[i]) if probs[i] else None)
        return [proposals[i] for i in range(len(drafters))]

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
            return [argmax(logits)], []
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
            choices = argmax(logits)  # [m + 1]
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

    def _propose_tree(self, request: DraftRequest) -> Proposal:
        """Branches of greedy drafts from the top first tokens.

        Deterministic (q one-hot per node) under sampling too. Level d holds node d * b + j of
        branch j; each node sees the context, its own branch and itself.
        """
        self._context_length = request.tokens.shape[0]
        logits = self._fit_vocab(self.lm.forward_last(request.tokens[self.lm.length:]))  # [vocab]
        width = min(self.tree.topk, self.vocab_size)
        depth = max(1, min(request.k, self.tree.nodes // width))
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
            levels.append(argmax(self._fit_vocab(level_logits)))
        tokens = torch.cat(levels)  # [depth * b], level by level
        parents = (torch.arange(tokens.shape[0], device=device) - width).clamp_min(-1)
        return Proposal(tokens, parents=parents)

    def commit(self, num_accepted: int) -> None:
        if self.tree is not None:  # tree nodes are dropped; accepted tokens are re-fed next time
            self.lm.rewind(self._context_length)
            return
        # The cache holds the context plus all drafts but the last; accepted ones stay valid.
        self.lm.rewind(min(self.lm.length, self._context_length + num_accepted))
