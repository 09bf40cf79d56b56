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


# Speculation off from 8 sequences on: where it stopped paying on held-out prompts
# (docs/batching.md, "Where speculation stops paying").
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
