"""Lookahead decoding (Fu et al. 2024): Jacobi iteration fills an n-gram pool, the target verifies.

Training-free and model-free: the target itself, in the same forward that verifies the draft,
runs a side branch (verispec.core.types.SideBranch) that advances a window of guesses for the next W
positions by one Jacobi iteration. The window keeps its last N - 1 iterations (levels); each
column of levels is a run of N - 1 consecutive guesses, which with the newest prediction makes an
n-gram for the pool. Each step drafts the (up to G) pooled n-grams that start with the last
committed token, merged into a token tree; the draft is deterministic (q one-hot), so greedy and
exact tree sampling both keep the target's output. The window moves forward one position per
step however many tokens were accepted, as the reference implementation does by default.
"""

from __future__ import annotations

import torch

from verispec.core.argmax import argmax
from verispec.core.errors import VerispecError
from verispec.core.types import Proposal, SideBranch
from verispec.drafters.base import Drafter, DraftRequest
from verispec.drafters.ngram import trie


def lookahead_branch(levels: int, window: int, num_draft: int,
                     device: torch.device | str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Offsets [m] and mask [m, 1 + num_draft + m] of a window of `levels` rows of `window`
    guesses, m = levels * window, row-major (level 0, the oldest, first), after a draft of
    num_draft nodes.

    Guess (l, i) sits at offset i + 1 + l from the root and sees the root, level 0's guesses
    0..i and the guesses of column i in levels 1..l: the run of consecutive offsets 1..i + 1 + l
    it continues. It sees no draft node. Its prediction is the next guess for offset i + 2 + l.

    Example, 2 levels of window 2, no draft: guesses a0 a1 (level 0), b0 b1 (level 1) at offsets
    [1, 2, 2, 3]; a0 sees {root, a0}, a1 {root, a0, a1}, b0 {root, a0, b0}, b1 {root, a0, a1, b1}.
    """
    level = torch.arange(levels, device=device).repeat_interleave(window)  # [m]
    column = torch.arange(window, device=device).repeat(levels)  # [m]
    base = (level[None] == 0) & (column[None] <= column[:, None])  # level 0 up to the own column
    own = (column[None] == column[:, None]) & (level[None] <= level[:, None])  # own column, below
    m = levels * window
    mask = torch.zeros(m, 1 + num_draft + m, dtype=torch.bool, device=device)
    mask[:, 0] = True
    mask[:, 1 + num_draft:] = base | own
    return column + 1 + level, mask


class LookaheadDrafter(Drafter):
    """Lookahead decoding's drafter: a Jacobi window of `window` (W) guesses over the last
    `ngram` - 1 (N - 1) iterations, and an n-gram pool keeping up to `guesses` (G) n-grams per
    first token (least recently seen dropped first). With `pool_context` the committed text's
    own n-grams join the pool too (the reference implementation's POOL_FROM_PROMPT).

    Each step drafts the pooled n-grams after the last committed token, each cut to k tokens,
    merged into a trie; the target scores them and the W * (levels) window guesses in one forward.
    """

    def __init__(self, window: int, ngram: int, guesses: int, pool_context: bool = False) -> None:
        """Defaults: DraftOptions.lookahead_*."""
        for name, value, least in (("window W", window, 1), ("n-gram size N", ngram, 2),
                                   ("guesses G", guesses, 0)):
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise VerispecError(f"lookahead {name} must be an integer >= {least}, got {value!r}")
        self.window = window
        self.ngram = ngram
        self.guesses = guesses
        self.pool_context = pool_context
        self.reset()

    def reset(self) -> None:
        self.levels: list[list[int]] = []  # oldest first, `window` guesses each; empty: not started
        self.pool: dict[int, list[tuple[int, ...]]] = {}  # first token -> tails, most recent last
        self.absorbed = 0  # context tokens whose n-grams are in the pool (pool_context)

    def _remember(self, first: int, tail: tuple[int, ...]) -> None:
        """Put an n-gram in the pool as the most recent one for `first`, keeping G at most."""
        tails = self.pool.setdefault(first, [])
        if tail in tails:
            tails.remove(tail)
        tails.append(tail)
        if len(tails) > self.guesses:
            del tails[0]

    def _absorb(self, context: torch.Tensor) -> None:
        """Pool the context's n-grams not pooled yet. context: [length]."""
        start = max(0, self.absorbed - self.ngram + 1)
        tokens = context[start:].tolist()
        for i in range(len(tokens) - self.ngram + 1):
            self._remember(tokens[i], tuple(tokens[i + 1: i + self.ngram]))
        self.absorbed = context.shape[0]

    def propose(self, request: DraftRequest) -> Proposal:
        context, device = request.tokens, request.tokens.device
        if not self.levels:  # first guesses: the context's last W tokens (Jacobi needs some start)
            recent = context[-self.window:].tolist()
            self.levels = [(recent * self.window)[: self.window]]
        if self.pool_context:
            self._absorb(context)
        seen: list[tuple[int, ...]] = []
        for tail in reversed(self.pool.get(int(context[-1]), [])):
            if tail[: request.k] not in seen:
                seen.append(tail[: request.k])
        tokens, parents = trie([list(t) for t in seen], self.guesses * (self.ngram - 1))
        offsets, mask = lookahead_branch(len(self.levels), self.window, len(tokens), device)
        side = SideBranch(torch.tensor(sum(self.levels, []), device=device), offsets, mask)
        return Proposal(torch.tensor(tokens, dtype=torch.int64, device=device),
                        parents=torch.tensor(parents, dtype=torch.int64, device=device), side=side)

    def observe_side(self, logits: torch.Tensor) -> None:
        """One Jacobi iteration: the newest level's rows predict the next guesses; a full window
        yields one n-gram per column and drops its oldest level. logits: [m, vocab]."""
        newest = argmax(logits[-self.window:]).tolist()
        if len(self.levels) == self.ngram - 1:
            oldest, *rest = self.levels
            for i in range(self.window):
                self._remember(oldest[i], tuple(level[i] for level in rest) + (newest[i],))
            self.levels = rest
        self.levels.append(newest)

    def commit(self, num_accepted: int) -> None:
        pass
