"""A drafter network's steps on a GPU as fixed-shape passes, replayed from CUDA graphs.

On a GPU a small drafter is launch-bound as the target is (verispec.model.graphs): one EAGLE
layer, run eagerly, is a few dozen kernels, each waiting on Python, per drafted token. Here every
call of the network runs as passes of exactly ROWS rows over a key buffer of fixed capacity,
written by index (`PassCache`), each row attending over the whole buffer through the pass's mask:
nothing in a pass depends on a Python number, so it is captured once and replayed. A drafter needs
no batch invariance (only the target's bits decide the output), so the rows may come in any
grouping; the passes are for speed alone.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from verispec.model.graphs import STATIC_KEYS, StaticPasses, graphs_enabled
from verispec.model.kv_cache import KVCache

# Rows of one pass: a chain step feeds one, catching up after a verify feeds up to k + 1, a tree
# level up to its width; more run as several passes.
ROWS = 16
# Entries a drafter's cache holds: the target's context and a tree's drafted nodes after it.
CAPACITY = -(-(STATIC_KEYS + 256 + 1) // 64) * 64


class PassCache(KVCache):
    """One drafter layer's keys and values in fixed buffers: `append` writes a pass's rows at the
    slots its `passes` were loaded with (padding rows into the scratch slot) and returns the whole
    buffers, which the rows read through the pass's mask. `length` counts the entries in use."""

    def __init__(self, passes: StaticPasses) -> None:
        super().__init__()
        self.passes = passes

    def append(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """keys, values: [1, heads, ROWS, head_dim] -> the buffers [1, heads, capacity, head_dim]."""
        if self.keys is None:  # the first pass (not yet captured) sizes the buffers
            self.keys, self.values = (keys.new_zeros(1, keys.shape[1], self.passes.capacity, keys.shape[3])
                                      for _ in range(2))
        self.keys.index_copy_(2, self.passes.slots, keys)
        self.values.index_copy_(2, self.passes.slots, values)
        return self.keys, self.values


# net(embeds [1, ROWS, hidden], inputs [1, ROWS, hidden], positions [ROWS], cache, bias [ROWS,
# capacity], **extra) -> [1, ROWS, hidden]: an EAGLE net's signature (mask given as an additive bias).
Net = Callable[..., torch.Tensor]


class GraphedNet:
    """Runs a drafter network's calls (tokens, an input state per token, positions, an optional
    tree mask) as fixed-shape passes over its own `cache`, captured as CUDA graphs where graphs are
    on (`VERISPEC_CUDA_GRAPHS`). `extra` names further per-token inputs the network takes as
    keyword arguments (EAGLE's `mid`); a call that leaves them out runs its own graph."""

    def __init__(self, net: Net, embed: torch.nn.Embedding, device: torch.device, dtype: torch.dtype,
                 extra: tuple[str, ...] = ()) -> None:
        self.net, self.embed = net, embed
        self.passes = StaticPasses(ROWS, CAPACITY, {None}, dtype, device, graphs_enabled(device))
        self.cache = PassCache(self.passes)
        width = embed.embedding_dim
        # [ROWS, hidden] each: the pass's input states, and each extra input
        self.inputs = torch.zeros(ROWS, width, dtype=dtype, device=device)
        self.extra = {name: torch.zeros(ROWS, width, dtype=dtype, device=device) for name in extra}

    @torch.inference_mode()
    def __call__(self, tokens: torch.Tensor, inputs: torch.Tensor, positions: torch.Tensor,
                 mask: torch.Tensor | None = None, **extra: torch.Tensor) -> torch.Tensor:
        """tokens, positions: [n]; inputs and each extra: [n, hidden]; mask: [n, cached + n] bool
        (True = attend; None: causal after the cache). Appends the n rows to the cache; returns the
        network's outputs [n, hidden]."""
        past, n = self.cache.length, tokens.shape[0]
        visible = (torch.ones(n, past + n, dtype=torch.bool, device=tokens.device).tril(past)
                   if mask is None else mask)
        given = tuple(sorted(extra))
        out = []
        for first in range(0, n, ROWS):
            end = min(n, first + ROWS)
            self.passes.load(past, tokens[first:end], positions[first:end], visible[first:end], first,
                             positions)
            self.inputs[: end - first] = inputs[first:end]
            for name in given:
                self.extra[name][: end - first] = extra[name][first:end]
            result = self.passes.run(given, self._pass(given))
            out.append(result[: end - first].clone())
            self.cache.length = past + end
        return torch.cat(out) if len(out) > 1 else out[0]

    def _pass(self, given: tuple[str, ...]) -> Callable[[], torch.Tensor]:
        passes = self.passes

        def forward() -> torch.Tensor:  # [ROWS, hidden], every input a static buffer
            return self.net(self.embed(passes.tokens)[None], self.inputs[None], passes.positions, self.cache,
                            passes.biases[None], **{name: self.extra[name][None] for name in given})[0]
        return forward
