"""A Hugging Face causal LM with its own KV cache that can be advanced and rewound.

The engine holds one per sequence for the target; model-based drafters hold their own.
`forward_rows` feeds several sequences' blocks in one pass.
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING

import torch

from verispec.core.tree import attention_mask, chain_parents, is_chain, position_ids, side_block
from verispec.core.types import GenerationStats, SideBranch
from verispec.model.kernels import rows
from verispec.model.lean import FIXED_ROWS, WIDE_ROWS, Block, LeanDecoder, lean_supported
from verispec.model.lean import forward_rows as lean_forward_rows
from verispec.model.lowbit import QuantLinear, weight_format
from verispec.model.packed import packed_view

if TYPE_CHECKING:
    from transformers import DynamicCache, PreTrainedModel

# Classes whose logits are exactly lm_head(last hidden state): no soft-capping or logit scaling.
PLAIN_HEAD_CLASSES = frozenset({"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM",
                                "Qwen3ForCausalLM"})


def _hf_cache(model: PreTrainedModel) -> DynamicCache:
    """An empty Hugging Face cache for a model that runs through its own forward (imported here:
    transformers takes seconds to import, and a lean model never needs it)."""
    from transformers import DynamicCache

    return DynamicCache(config=model.config)


class CachedModel:
    """Feeds tokens through `model`, keeping their keys and values; `rewind` drops the newest."""

    def __init__(self, model: PreTrainedModel, pad_to_multiple: int | None = None,
                 pack: bool = True, lean: LeanDecoder | None = None) -> None:
        """pad_to_multiple: feed multi-token blocks padded to a multiple of this many tokens.
        pack: run on CPU with prepacked weights where the model allows: Llama-shaped decoders
        through verispec.model.lean (fused products, a preallocated cache), others through their own
        forward with prepacked linear layers (verispec.model.packed).
        lean: run this lean decoder instead of one over `model`'s own weights (a low-precision
        copy of them, say: verispec.drafters.self_spec).

        On CPU through F.linear, matrix products over 2, 3, 7 or 11 rows take up to twice as long
        as over 4, 8 or 12, so by default a block of n > 1 tokens on CPU is padded to a multiple of
        4 and the padding is dropped from the cache and the logits. Padding comes after the real
        tokens, which cannot attend to it. Prepacked, the row count hardly matters and the padding
        costs as little; the lean path is not padded (there 2 and 3 tokens cost less than 4).
        Figures: docs/performance.md, "Figures behind the target's design".
        """
        self.model = model
        if lean is None and pack and lean_supported(model):
            lean = LeanDecoder.of(model)
        self.lean = lean
        # Hugging Face's cache, for the models that run through their own forward.
        self.cache = _hf_cache(model) if self.lean is None else None
        if pad_to_multiple is None:
            pad_to_multiple = 4 if model.device.type == "cpu" and self.lean is None else 1
        self.pad_to_multiple = pad_to_multiple
        # The module tree the tokens go through when not lean: `model` or its prepacked view.
        self.runner = None if self.lean is not None else packed_view(model) if pack else model
        # Logits are lm_head(last hidden state): read the head on the n real rows only.
        self.plain_head = type(model).__name__ in PLAIN_HEAD_CLASSES

    @property
    def length(self) -> int:
        """Number of tokens whose keys and values are cached."""
        if self.lean is not None:
            return self.lean.length
        return self.cache.get_seq_length()

    @property
    def device(self) -> torch.device:
        return self.model.device

    @property
    def invariance(self) -> str:
        """Which batch-invariance mode runs the target (docs/invariance.md): "row-attention" (a
        position's logits and keys do not depend on its block, tree or batch), "off" (a lean
        decoder with it switched off), "none" (the model's own Hugging Face forward)."""
        if self.lean is None:
            return "none"
        return "row-attention" if self.lean.invariant else "off"

    @property
    def precision(self) -> str:
        """What the target's layers are in: "int4" (a 4-bit target), else its dtype's name."""
        return weight_format(self.model)

    @property
    def kernel(self) -> str:
        """How the target's linear products run, for stats and reports; where the row kernels
        run, which class and why (rows.choice())."""
        described = self._products()
        if "verispec rows" not in described:
            return described
        chosen = rows.choice()
        return f"{described}; row kernels {chosen.name}: {chosen.why}"

    def _products(self) -> str:
        lean = self.lean
        attention = ""
        if lean is not None and lean.invariant and lean.weights.row_kernel_attention:
            arithmetic = rows.attention_arithmetic(self.model.dtype, lean.weights.head_dim)
            attention = f"; attention verispec rows ({arithmetic})"
        quantized = {m.kernel.name: None for m in self.model.modules() if isinstance(m, QuantLinear)}
        if quantized:  # a 4-bit target: its layers', then its head's
            return "; ".join(quantized) + attention
        dtype = str(self.model.dtype).removeprefix("torch.")
        if self.lean is not None and self.lean.passes is not None:
            passes = self.lean.passes
            runs = "CUDA graphs" if passes.graphs else "eager"
            if passes.failure:
                runs = f"eager: {passes.failure}"
            return (f"{dtype} (fused F.linear at {FIXED_ROWS} rows; fixed-shape passes over "
                    f"{passes.room} keys, {runs})")
        if self.lean is not None and self.model.device.type != "cpu":
            return f"{dtype} (fused F.linear at {FIXED_ROWS} rows)"
        if self.lean is not None:
            dense_rows = isinstance(self.lean.weights.layers[0].qkv, rows.DenseProduct)
            runs = rows.name() if dense_rows else "oneDNN prepacked"
            if min(self.lean.weights.min_rows.values()) == WIDE_ROWS:
                runs += f", fewer than {WIDE_ROWS} rows padded to {WIDE_ROWS} (timed faster at load)"
            return f"{dtype} ({runs}, fused){attention}"
        packed = "oneDNN prepacked, " if self.runner is not self.model else ""
        return f"{dtype} ({packed}Hugging Face forward)"

    @property
    def path(self) -> str:
        """Which forward runs the target: "lean (FAMILY)" (verispec.model.lean: batch-invariant by
        construction) or "Hugging Face forward (CLASS)" (a model of no lean family, or one that
        cannot run lean here)."""
        if self.lean is not None:
            return f"lean ({self.lean.weights.family.name})"
        return f"Hugging Face forward ({type(self.model).__name__})"

    def stats(self) -> GenerationStats:
        """Empty statistics naming this target's path, dtype, kernel and invariance mode."""
        return GenerationStats(invariance=self.invariance, dtype=self.precision, kernel=self.kernel,
                               path=self.path)

    def reset(self) -> None:
        if self.lean is not None:
            self.lean.reset()
        else:
            self.cache = _hf_cache(self.model)

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """Append tokens [n] to the cache; return logits [n, vocab] (float32)."""
        return self.forward_hidden(tokens)[0]

    @torch.inference_mode()
    def forward_last(self, tokens: torch.Tensor) -> torch.Tensor:
        """Append tokens [n] to the cache; return the last one's logits [vocab] (float32).
        The LM head reads one row, not n: a prompt's logits are mostly never looked at."""
        return self.forward_tail(tokens, 1)[0]

    @torch.inference_mode()
    def forward_tail(self, tokens: torch.Tensor, count: int) -> torch.Tensor:
        """Append tokens [n] to the cache; return the logits of the last `count` [count, vocab]."""
        return self._forward(tokens, tokens.shape[0], None, None, slice(-count, None))[0]

    @torch.inference_mode()
    def prefill(self, tokens: torch.Tensor, layers: tuple[int, ...] = ()) -> torch.Tensor:
        """Append tokens [n] to the cache; return their final hidden states [n, hidden] (and
        those after `layers`, as in forward_hidden), without reading any logits (for a 500-token
        prompt the LM head would be a fifth of the work)."""
        return self._forward(tokens, tokens.shape[0], None, None, slice(0), layers)[1]

    @torch.inference_mode()
    def forward_hidden(self, tokens: torch.Tensor, parents: torch.Tensor | None = None,
                       layers: tuple[int, ...] = (),
                       side: SideBranch | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Append tokens [n] to the cache; return logits [n, vocab] (float32) and the final
        (normed) hidden states [n, hidden] that the logits were read from, followed by the
        residual states after the first L layers for each L in `layers` (increasing; Hugging
        Face's hidden_states[L]): [n, hidden * (1 + len(layers))].

        parents: [n - 1], the tree of tokens[1:] under tokens[0] (see verispec.core.tree); None or a
        chain is plain causal attention. A tree goes through the model's own attention as a 4D
        mask with position ids = context + depth; `keep` then compacts the cache.
        side: tokens[n - m:] are a side branch of m tokens after the tree (tree.side_block).
        """
        n = tokens.shape[0]
        padding = -n % self.pad_to_multiple if n > 1 else 0
        if padding:
            tokens = torch.cat([tokens, tokens[-1:].expand(padding)])
        mask, positions = self._tree_inputs(parents, padding, side)
        return self._forward(tokens, n, mask, positions, layers=layers)

    def _tree_inputs(self, parents: torch.Tensor | None, padding: int = 0,
                     side: SideBranch | None = None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The 4D mask and position ids of a tree block (and side branch) after the cache (None,
        None: causal)."""
        past = self.length
        if side is not None:
            n = 1 + side.mask.shape[1] - 1 - side.tokens.shape[0]  # root + draft nodes
            tree = chain_parents(n - 1, side.tokens.device) if parents is None else parents
            return side_block(tree, side.mask, side.offsets, past, padding)
        if is_chain(parents):
            return None, None
        return attention_mask(parents, past, padding), position_ids(parents, past, padding)

    @torch.inference_mode()
    def forward_masked(self, tokens: torch.Tensor, mask: torch.Tensor,
                       positions: torch.Tensor) -> torch.Tensor:
        """Append tokens [m] that see only what mask [m, length + m] (bool) allows, at positions
        [m]; return their logits [m, vocab]. For drafters that grow a tree level by level."""
        return self._forward(tokens, tokens.shape[0], mask[None, None], positions)[0]

    def _forward(self, tokens: torch.Tensor, n: int, mask: torch.Tensor | None,
                 positions: torch.Tensor | None, rows: slice = slice(None),
                 layers: tuple[int, ...] = ()) -> tuple[torch.Tensor, torch.Tensor]:
        """Run tokens [n + padding] through the model; keep the first n in the cache. Returns the
        logits of the rows `rows` of those n, and all n hidden states (with those after
        `layers`)."""
        padding = tokens.shape[0] - n
        if self.lean is not None:
            hidden = self.lean.forward(tokens, positions, None if mask is None else mask[0, 0],
                                       layers)[:n]
            self.lean.rewind(self.lean.length - padding)
            final = hidden[:, : hidden.shape[1] // (1 + len(layers))]
            return self.lean.logits(final[rows]).float(), hidden
        inputs = {"input_ids": tokens.unsqueeze(0), "past_key_values": self.cache, "use_cache": True}
        if mask is not None:
            inputs["attention_mask"] = mask
            inputs["position_ids"] = positions.unsqueeze(0)
        if self.plain_head:
            out = self.runner.model(**inputs, output_hidden_states=bool(layers))
            hidden = out.last_hidden_state[0, :n]
            logits = self.runner.get_output_embeddings()(hidden[rows])
        else:
            out = self.runner(**inputs, output_hidden_states=True)
            logits, hidden = out.logits[0, :n][rows], out.hidden_states[-1][0, :n]
        if layers:
            hidden = torch.cat([hidden, *(out.hidden_states[layer][0, :n] for layer in layers)], -1)
        if padding:
            self.cache.crop(-padding)
        return logits.float(), hidden

    def copy_from(self, other: CachedModel) -> None:
        """Make this cache hold what `other`'s holds (samples of one prompt share its prefill)."""
        if self.lean is not None:
            for mine, theirs in zip(self.lean.caches, other.lean.caches):
                mine.rewind(0)
                mine.append(*theirs.filled())
        else:
            self.cache = copy.deepcopy(other.cache)

    def rewind(self, length: int) -> None:
        """Keep only the first `length` cached tokens."""
        if self.lean is not None:
            self.lean.rewind(length)
            return
        drop = self.length - length
        if drop > 0:
            self.cache.crop(-drop)

    def keep(self, start: int, rows: list[int]) -> None:
        """Keep the first `start` cached tokens, then only the block rows `rows` after them (in
        that order): compacts the accepted path of a tree into place and drops the rest."""
        if rows == list(range(len(rows))):
            self.rewind(start + len(rows))
            return
        if self.lean is not None:
            self.lean.keep(start, rows)
            return
        index = torch.tensor(rows, device=self.device) + start
        index = torch.cat([torch.arange(start, device=self.device), index])
        for layer in self.cache.layers:
            layer.keys = layer.keys.index_select(-2, index)
            layer.values = layer.values.index_select(-2, index)


@torch.inference_mode()
def forward_rows(models: list[CachedModel], blocks: list[torch.Tensor],
                 parents: list[torch.Tensor | None], layers: tuple[int, ...] = (),
                 sides: list[SideBranch | None] | None = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """forward_hidden for several sequences at once: models[i] (one per sequence, same model)
    takes blocks[i] [n_i] under tree parents[i] (and side branch sides[i]); returns (logits
    [n_i, vocab], hidden [n_i, hidden * (1 + len(layers))]) per sequence.

    Lean decoders run as one pass (verispec.model.lean.forward_rows: one read of the weights for all
    rows, the LM head included); models off the lean path run one sequence after another.
    """
    sides = sides or [None] * len(models)
    lean = [model.lean for model in models]
    if not _one_pass(lean):
        return [model.forward_hidden(block, tree, layers, side)
                for model, block, tree, side in zip(models, blocks, parents, sides)]
    inputs = []
    for model, block, tree, side in zip(models, blocks, parents, sides):
        mask, positions = model._tree_inputs(tree, 0, side)
        inputs.append(Block(block, positions, None if mask is None else mask[0, 0]))
    hidden = lean_forward_rows(lean, inputs, layers)
    width = hidden.shape[1] // (1 + len(layers))
    logits = lean[0].logits(hidden[:, :width]).float()
    sizes = [block.shape[0] for block in blocks]
    return list(zip(logits.split(sizes), hidden.split(sizes)))


@torch.inference_mode()
def forward_tails(models: list[CachedModel], blocks: list[torch.Tensor], tails: list[int]
                  ) -> list[torch.Tensor]:
    """forward_tail for several sequences at once (drafters stepping a batch): models[i] takes
    blocks[i] [n_i] and returns the logits of its last tails[i] tokens [tails[i], vocab]; one pass
    where the models are lean over the same weights."""
    lean = [model.lean for model in models]
    if not _one_pass(lean):
        return [model.forward_tail(block, tail) for model, block, tail in zip(models, blocks, tails)]
    hidden = lean_forward_rows(lean, [Block(block) for block in blocks])
    ends = torch.tensor([block.shape[0] for block in blocks]).cumsum(0).tolist()
    rows = torch.cat([torch.arange(end - tail, end) for end, tail in zip(ends, tails)])
    return list(lean[0].logits(hidden[rows.to(hidden.device)]).float().split(tails))


def _one_pass(lean: list[LeanDecoder | None]) -> bool:
    """Whether these decoders can run as one pass: several, all lean over the same weights."""
    return len(lean) > 1 and all(d is not None and d.weights is lean[0].weights for d in lean)
