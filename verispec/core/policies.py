"""Draft-length policies: how many tokens to draft next step, updated from what was accepted."""

from __future__ import annotations

from typing import Protocol


class DraftLengthPolicy(Protocol):
    def next_k(self) -> int: ...

    def update(self, num_drafted: int, num_accepted: int) -> None: ...


class ConstantK:
    """Always draft k tokens (k = 0: no drafting, plain decoding)."""

    def __init__(self, k: int) -> None:
        self.k = k

    def next_k(self) -> int:
        return self.k

    def update(self, num_drafted: int, num_accepted: int) -> None:
        pass


class HeuristicK:
    """Hugging Face's schedule: +2 after a fully accepted draft, -1 (not below 1) otherwise."""

    def __init__(self, k: int) -> None:
        self.k = max(1, k)

    def next_k(self) -> int:
        return self.k

    def update(self, num_drafted: int, num_accepted: int) -> None:
        if num_drafted == 0:
            return
        self.k = self.k + 2 if num_accepted == num_drafted else max(1, self.k - 1)


SCHEDULES = {"constant": ConstantK, "heuristic": HeuristicK}


# Speculation off from 8 sequences on. Measured 2026-11-23 on the 2-core AMD EPYC (AVX512-BF16),
# SmolLM2-135M float32, 8 held-out prompts (training.prompts seed 795), 64 new tokens, batches of
# those prompts, other processes paused, throughput against batched ar in the same run:
# batch 4: self-int4-pld k 10 1.06x, k 1-4 0.92-0.93x, pld k 3 0.94x; batch 8: pld k 1 1.05x,
# self-int4-pld k 2 0.90x, k 4 0.84x; batch 16: pld k 1-3 0.92-0.93x, self-int4-pld k 1-10
# 0.77-0.79x. At 8 rows a target pass costs 44 ms against 31 ms for one row: verifying drafts is
# no longer nearly free, and the int4 drafter over 8 rows (36 ms) costs almost what the target does.
BATCH_LIMITS = ((8, 0),)


class LoadCap:
    """The most tokens each sequence may draft when `batch` sequences share a target pass.

    As the batch grows the target pass turns from reading weights to computing, and verifying
    drafts that will be refused stops being free (vLLM turns speculation off above a batch size).
    limits: (smallest batch size, cap) pairs, increasing; below the first, no cap. Default:
    BATCH_LIMITS, measured on this project's CPU; `()`: never capped.
    """

    def __init__(self, limits: tuple[tuple[int, int], ...] | None = None) -> None:
        self.limits = BATCH_LIMITS if limits is None else limits

    def k(self, batch: int) -> int | None:
        """The cap for this batch size (None: none)."""
        cap = None
        for size, limit in self.limits:
            if batch >= size:
                cap = limit
        return cap
