"""Block drafter (DFlash-style, arXiv 2602.06036): one pass of a small decoder drafts k tokens.

The target hands over, at every committed position i, its final state h_i and its residual states
after a few layers (EAGLE-3's aux layers); `fc` and a norm fuse them into one context feature c_i.
The drafter's block is the newest committed token x_n (whose own state the target has not yet
given) at position n, then k mask slots (one learned embedding) at positions n+1..n+k; each row
enters as `fuse` of its embedding and the newest context feature c_{n-1} (the newest token's row
is then EAGLE's input: the token and the state before it). Each of the drafter's layers attends
from the block's rows to its own key/value projections of c_0..c_{n-1} (cached: one new entry
per committed position) and to the block's rows up to itself. Slot j, read out through a final
norm and the target's LM head (restricted to a frequency-ranked vocabulary, see ReducedHead), is
the draft of x_{n+j}: one pass drafts the whole block.

No slot sees a drafted token, so slot j's distribution q_j does not depend on the tokens drafted
before it; it is still the law x_{n+j} is drawn from given everything before it, so sampling
each slot from its own warped q_j is exact speculative sampling (the verifier checks each token
against the target's p given the drafted prefix). The block is causal, so a block of k slots
gives the first k slots of a longer one: any k up to the trained block size runs as trained.

Drafting, chains or static trees, is MedusaDrafter's: the slots play the heads' part, their rank
accuracies (measured by `verispec train block`) shape the tree.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from verispec.core.errors import VerispecError
from verispec.core.tree import TreeSettings
from verispec.drafters.base import DraftRequest
from verispec.drafters.learned import ReducedHead
from verispec.drafters.medusa import MedusaDrafter
from verispec.drafters.nn import RMSNorm, rotary
from verispec.model.graphs import sdpa
from verispec.model.kv_cache import KVCache

if TYPE_CHECKING:
    from transformers import PreTrainedModel


class BlockLayer(nn.Module):
    """A pre-norm decoder layer whose keys and values come from the context features as well as
    from its own rows. Split in three for the two callers: `context_kv` (the context's keys and
    values, cached while drafting), `project` (the rows' queries, keys and values), `finish`
    (attention over both, then the MLP)."""

    def __init__(self, hidden: int, heads: int, intermediate: int) -> None:
        super().__init__()
        if hidden % heads:
            raise VerispecError(f"hidden size {hidden} is not a multiple of {heads} heads")
        self.heads, self.head_dim = heads, hidden // heads
        self.attn_norm = RMSNorm(hidden)
        self.q = nn.Linear(hidden, hidden, bias=False)
        self.kv = nn.Linear(hidden, 2 * hidden, bias=False)
        self.out = nn.Linear(hidden, hidden, bias=False)
        self.mlp_norm = RMSNorm(hidden)
        self.gate_up = nn.Linear(hidden, 2 * intermediate, bias=False)
        self.down = nn.Linear(intermediate, hidden, bias=False)

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        # [batch, T, hidden] -> [batch, heads, T, head_dim]
        return x.view(*x.shape[:2], self.heads, self.head_dim).transpose(1, 2)

    def _kv(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        keys, values = self.kv(x).chunk(2, dim=-1)
        return rotary(self._heads(keys), positions), self._heads(values)

    def context_kv(self, context: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """context: [batch, C, hidden] (already normed); positions: [C] -> keys, values
        [batch, heads, C, head_dim]."""
        return self._kv(context, positions)

    def project(self, x: torch.Tensor, positions: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x: [batch, T, hidden]; positions: [T] or [batch, T] -> queries, keys, values, each
        [batch, heads, T, head_dim]."""
        normed = self.attn_norm(x)
        return (rotary(self._heads(self.q(normed)), positions), *self._kv(normed, positions))

    def finish(self, x: torch.Tensor, queries: torch.Tensor, keys: torch.Tensor,
               values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """x: [batch, T, hidden] (the layer's input); queries [batch, heads, T, head_dim]; keys,
        values [batch, heads, K, head_dim] (the context's, then the rows'); mask [T, K] or
        [batch, 1, T, K] bool (True: attend) -> the layer's output [batch, T, hidden]."""
        attended = sdpa(queries, keys, values, attn_mask=mask)
        x = x + self.out(attended.transpose(1, 2).reshape(x.shape))
        gate, up = self.gate_up(self.mlp_norm(x)).chunk(2, dim=-1)
        return x + self.down(nn.functional.silu(gate) * up)


class BlockNet(nn.Module):
    """fc + norm (the context features), the mask slot's embedding, `fuse` (a row's input from
    its embedding and the newest context feature), `layers` BlockLayers and the final norm.
    `feature_layers`: the target layers whose residual states it reads after the target's final
    state; `block`: rows of a block (the newest token and block - 1 slots)."""

    def __init__(self, hidden: int, heads: int, intermediate: int, layers: int, block_size: int,
                 feature_layers: list[int]) -> None:
        super().__init__()
        self.block, self.feature_layers = block_size, tuple(feature_layers)
        self.fc = nn.Linear((1 + len(feature_layers)) * hidden, hidden, bias=False)
        self.context_norm = RMSNorm(hidden)
        self.mask = nn.Parameter(0.02 * torch.randn(hidden))
        self.fuse = nn.Linear(2 * hidden, hidden, bias=False)
        self.layers = nn.ModuleList(BlockLayer(hidden, heads, intermediate) for _ in range(layers))
        self.norm = RMSNorm(hidden)

    @property
    def num_heads(self) -> int:
        """Tokens one pass drafts at most (MedusaDrafter reads the slots as its heads)."""
        return self.block - 1

    def context(self, states: torch.Tensor) -> torch.Tensor:
        """The target's states [..., hidden * (1 + len(feature_layers))] -> context features
        [..., hidden]."""
        return self.context_norm(self.fc(states))

    def rows(self, embeds: torch.Tensor, newest: torch.Tensor) -> torch.Tensor:
        """The block's rows as the first layer reads them: embeds [..., hidden] (the newest
        token's, then the mask's) fused with the newest context feature [..., hidden]."""
        return self.fuse(torch.cat([embeds, newest], dim=-1))

    def forward(self, rows: torch.Tensor, positions: torch.Tensor, context: torch.Tensor,
                mask: torch.Tensor) -> torch.Tensor:
        """Every layer over rows [batch, T, hidden] (`rows`' output, at positions [T] or
        [batch, T]) and the context features [batch, C, hidden] at positions 0..C-1; mask
        [T, C + T] or [batch, 1, T, C + T] bool. Returns the normed outputs [batch, T, hidden].
        (Drafting runs the same layers with the context's keys and values cached:
        BlockDrafter._features.)"""
        context_positions = torch.arange(context.shape[1], device=context.device)
        x = rows
        for layer in self.layers:
            context_keys, context_values = layer.context_kv(context, context_positions)
            queries, keys, values = layer.project(x, positions)
            x = layer.finish(x, queries, torch.cat([context_keys, keys], 2),
                             torch.cat([context_values, values], 2), mask)
        return self.norm(x)


def block_settings(target: PreTrainedModel, feature_layers: tuple[int, ...], layers: int = 2,
                   block: int = 8) -> dict:
    """A block drafter for `target`: `layers` layers as wide as the target's, with half its MLP
    width (2.65 M weights a layer on the built-in model), reading its final state and its states
    after `feature_layers`; blocks of `block` rows (block - 1 drafted tokens)."""
    config = target.config.get_text_config(decoder=True)
    if layers < 1 or block < 2:
        raise VerispecError(f"a block drafter needs >= 1 layer and a block of >= 2 rows, got "
                            f"{layers} layers and {block} rows")
    return {"hidden": int(config.hidden_size), "heads": int(config.num_attention_heads),
            "intermediate": int(config.intermediate_size) // 2, "layers": layers, "block_size": block,
            "feature_layers": list(feature_layers)}


class BlockDrafter(MedusaDrafter):
    """Drafts min(k, block - 1) tokens in one pass (see the module docstring): a chain, or with
    `tree` settings a static tree over each slot's top tokens."""

    kind = "block"
    net_class = BlockNet

    def __init__(self, target: PreTrainedModel, net: BlockNet, head: ReducedHead,
                 tree: TreeSettings | None = None,
                 rank_accuracy: list[list[float]] | None = None) -> None:
        super().__init__(target, net, head, tree, rank_accuracy)
        self.embed = target.get_input_embeddings()
        self.hidden_layers = net.feature_layers  # the engine hands these states over too
        self.caches = [KVCache() for _ in net.layers]
        self.real = 0  # committed positions whose context keys and values are cached
        self.newest: torch.Tensor | None = None  # [hidden]: the context feature at real - 1

    def reset(self) -> None:
        self.caches = [KVCache() for _ in self.caches]
        self.real, self.newest = 0, None

    def _features(self, request: DraftRequest, k: int) -> torch.Tensor:
        """The block's k slots after the newest token, normed: [k, hidden]. The context's keys
        and values are added for the committed positions not yet cached; the block's own are
        dropped after the pass (the cache holds committed positions only: nothing to rewind)."""
        states = request.target_hidden  # [n, hidden * (1 + len(hidden_layers))]
        n, size = states.shape[0], self.embed.embedding_dim
        if states.shape[1] != size * (1 + len(self.hidden_layers)):
            raise VerispecError(f"this block drafter reads the target's final state and its states "
                                f"after layers {list(self.hidden_layers)}: "
                                f"{size * (1 + len(self.hidden_layers))} values a position, got "
                                f"{states.shape[1]}")
        device = states.device
        if self.real < n:
            context = self.net.context(states[None, self.real:])  # [1, new, hidden]
            positions = torch.arange(self.real, n, device=device)
            for layer, cache in zip(self.net.layers, self.caches):
                cache.append(*layer.context_kv(context, positions))
            self.real, self.newest = n, context[0, -1]
        embeds = torch.cat([self.embed(request.tokens[n:]),  # the newest token, at position n
                            self.net.mask.expand(k, size)])  # [1 + k, hidden]
        x = self.net.rows(embeds, self.newest.expand(1 + k, size))[None]  # [1, 1 + k, hidden]
        positions = torch.arange(n, n + 1 + k, device=device)
        mask = torch.ones(1 + k, n + 1 + k, dtype=torch.bool, device=device).tril(n)
        for layer, cache in zip(self.net.layers, self.caches):
            queries, keys, values = layer.project(x, positions)
            keys, values = cache.append(keys, values)
            x = layer.finish(x, queries, keys, values, mask)
            cache.rewind(n)
        return self.net.norm(x[0, 1:])
