"""What `verispec train KIND` trains: for each drafter kind (RECIPES, keyed by the drafters' own
`kind`), its module, its loss, its export.

All kinds learn from the same self-distillation data (verispec.training.data): the target's own
answers, its final hidden states h (its logits are h @ lm_head.T) and its exit-layer states.
Teacher distributions are the target's logits restricted to the drafter's reduced vocabulary.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
from torch import nn
from transformers import PreTrainedModel

from verispec.core.errors import VerispecError
from verispec.drafters.block import BlockDrafter, BlockNet, block_settings
from verispec.drafters.distilled import DraftStudent, draft_settings
from verispec.drafters.eagle import EagleDrafter, EagleNet, eagle_settings
from verispec.drafters.eagle3 import Eagle3Drafter, Eagle3Net, eagle3_settings
from verispec.drafters.hydra import HydraDrafter, HydraNet, hydra_settings
from verispec.drafters.learned import (
    CONFIG_FILE,
    ReducedHead,
    drafter_config,
    frequent_tokens,
    load_drafter,
    save_drafter,
)
from verispec.drafters.medusa import MedusaDrafter, MedusaNet, medusa_settings
from verispec.drafters.mtp import MTPDrafter, MTPNet, mtp_settings, unembedding_norm
from verispec.drafters.nn import RMSNorm
from verispec.drafters.trained_exit import ExitAdapter, exit_settings, new_adapter
from verispec.model.loading import LoadedModel
from verispec.training.data import Sequence, load_dataset
from verispec.training.losses import agreement, distill_loss, feature_loss, multi_head_backward
from verispec.training.trainer import TrainConfig, bf16_is_fast, train

# Block drafter: blocks trained per sequence per step (random answer positions as the newest token)
BLOCK_ANCHORS = 32


@dataclass(frozen=True)
class Batch:
    tokens: torch.Tensor  # [B, T] int64
    hidden: torch.Tensor  # [B, T, hidden] float32: the target's final hidden states
    exit_hidden: torch.Tensor  # [B, T, hidden] float32
    mask: torch.Tensor  # [B, T] bool: real (not padding) positions
    # [B, T] bool: real positions whose next token belongs to the answer (or corpus passage):
    # the predictions a drafter makes while decoding; the prompt's are trained on, not drafted.
    answer: torch.Tensor
    # [B, T, hidden * len(aux_layers)] float32: the states after the data's aux layers (EAGLE-3),
    # None where the data has none
    aux: torch.Tensor | None = None


def collate(items: list[Sequence], max_len: int) -> Batch:
    """Right-pad sequences (each cut to its last max_len tokens) into one batch."""
    cut = [max(0, len(s.tokens) - max_len) for s in items]  # tokens dropped from each start
    items = [Sequence(s.tokens[-max_len:], max(0, s.prompt_len - dropped), s.hidden[-max_len:],
                      s.exit_hidden[-max_len:], None if s.aux_hidden is None else s.aux_hidden[-max_len:])
             for s, dropped in zip(items, cut)]
    width = max(len(s.tokens) for s in items)
    size = items[0].hidden.shape[-1]
    tokens = torch.zeros(len(items), width, dtype=torch.int64)
    hidden = torch.zeros(len(items), width, size)
    exit_hidden = torch.zeros(len(items), width, size)
    mask = torch.zeros(len(items), width, dtype=torch.bool)
    answer = torch.zeros_like(mask)
    with_aux = all(s.aux_hidden is not None for s in items)
    aux = torch.zeros(len(items), width, items[0].aux_hidden.shape[-1]) if with_aux else None
    for row, s in enumerate(items):
        n = len(s.tokens)
        tokens[row, :n], mask[row, :n] = s.tokens, True
        answer[row, max(0, s.prompt_len - 1): n] = True
        hidden[row, :n], exit_hidden[row, :n] = s.hidden.float(), s.exit_hidden.float()
        if aux is not None:
            aux[row, :n] = s.aux_hidden.float()
    return Batch(tokens, hidden, exit_hidden, mask, answer, aux)


@dataclass(frozen=True)
class RecipeOptions:
    loss: str = "fkl"  # distillation loss: fkl, rkl or tvd
    vocab: int = 8192  # reduced draft vocabulary (most frequent answer tokens)
    heads: int = 4  # Medusa, Hydra and MTP heads
    unroll: int = 2  # EAGLE: also train on its own predicted features, this many steps deep
    feature_weight: float = 1.0  # EAGLE: feature regression weight (token loss weight is 0.1)
    exit_layer: int | None = None  # early exit: default from the data
    draft_layers: int = 2  # distilled draft model and block drafter: their own layers
    block: int = 8  # block drafter: rows of a block (the newest token, then block - 1 drafted)
    init: str | None = None  # start from this trained drafter's weights (same kind and target)
    mid_state: bool = False  # EAGLE: also read the target's state at the data's exit layer
    # EAGLE-3: train its own lm_head (it starts as the target's rows of the draft vocabulary)
    train_head: bool = True

    def __post_init__(self) -> None:
        if self.heads < 1:
            raise VerispecError(f"--heads must be >= 1 (draft heads to train), got {self.heads}")
        if self.block < 2:
            raise VerispecError(f"--block must be >= 2 (the newest token and a slot), got {self.block}")


class Recipe:
    """Binds a drafter kind to the target and data: module, loss function, export."""

    def __init__(self, kind: str, target: LoadedModel, meta: dict, sequences: list[Sequence],
                 options: RecipeOptions) -> None:
        if kind not in RECIPES:
            raise VerispecError(f"unknown drafter kind {kind!r}; choose from {', '.join(KINDS)}")
        model: PreTrainedModel = target.model
        self.kind, self.spec, self.target, self.options = kind, RECIPES[kind], model, options
        answers = [s.tokens[s.prompt_len:] for s in sequences]
        self.vocab_ids = frequent_tokens(answers, target.vocab_size, options.vocab,
                                         set(target.eos_token_ids))
        self.head = ReducedHead(model, self.vocab_ids)
        self.head_t = self.head.weight_t.float()  # [hidden, reduced]
        self.embed = model.get_input_embeddings().weight.detach().float()  # [vocab, hidden]
        self.norm: RMSNorm | None = None  # MTP: the target's final norm, before the LM head
        self.settings, self.module = self.spec.build(self, meta, sequences)
        if options.init is not None:
            self._warm_start(Path(options.init))

    def _warm_start(self, path: Path) -> None:
        """Load a trained drafter's own weights (its vocabulary is not kept: the network does not
        depend on it, and the reduced vocabulary follows the new data; except for EAGLE-3, whose
        own head is its vocabulary's)."""
        config, weights = load_drafter(path, self.target, self.kind)
        prefix = self.spec.prefix
        own = {k.removeprefix(prefix): v.float() for k, v in weights.items() if k.startswith(prefix)}
        if self.spec.own_head:  # its own head's rows are its vocabulary's: both are kept
            self.vocab_ids = weights["vocab_ids"].long()
            self.head = ReducedHead(self.target, self.vocab_ids)
            self.head_t = self.head.weight_t.float()
            self.settings["draft_vocab"] = len(self.vocab_ids)
        unfused = {k: v for k, v in self.settings.items() if k != "mid_layer"}
        if self.spec.mid_state and unfused != self.settings and config["settings"] == unfused:
            self.module.load_unfused(own)  # an EAGLE drafter without the mid-layer input
            return
        if config["settings"] != self.settings:
            raise VerispecError(f"the {self.kind} drafter in {path} has settings {config['settings']}, "
                                f"not {self.settings}: it cannot start this run")
        self.module.load_state_dict(own)

    def teacher(self, hidden: torch.Tensor) -> torch.Tensor:
        """The target's logits over the reduced vocabulary. hidden [..., hidden] -> [..., reduced]."""
        return hidden @ self.head_t

    def loss(self, items: list[Sequence], max_len: int) -> tuple[torch.Tensor | None, dict]:
        """(loss, metrics) of a batch; loss None where the kind has run its backward itself (MTP,
        while gradients are on)."""
        return self.spec.loss(self, collate(items, max_len))

    def _eagle(self, b: Batch) -> tuple[torch.Tensor, dict]:
        # Position i: (h_i, x_{i+1}) -> h_{i+1}. Unrolled step s feeds back the step s-1 predictions.
        # A predicted feature has no mid-layer state: from step 2 on, mid is None (zeros).
        mask, answer = b.mask[:, 1:], b.answer[:, 1:]
        actual = b.hidden[:, 1:]
        features = b.hidden[:, :-1]
        mid = b.exit_hidden[:, :-1] if self.module.mid_layer is not None else None
        total, metrics = 0.0, {}
        for step in range(self.options.unroll):
            width = features.shape[1]
            embeds = self.embed[b.tokens[:, step + 1: step + 1 + width]]
            predicted = self.module(embeds, features, torch.arange(width), mid=mid)
            mid = None
            target_h = actual[:, step: step + width]
            m = mask[:, step: step + width]
            student, teacher = self.teacher(predicted), self.teacher(target_h)
            loss = (self.options.feature_weight * feature_loss(predicted, target_h, m)
                    + 0.1 * distill_loss(student, teacher, self.options.loss, m))
            total = total + loss
            metrics.update(agreement(f"top1_step{step + 1}", student, teacher, m,
                                     answer[:, step: step + width]))
            features = predicted[:, :-1]  # predicted h_{i+1}, paired next with x_{i+2}
        metrics["loss"] = float(total.detach())
        return total, metrics

    def _eagle3(self, b: Batch) -> tuple[torch.Tensor, dict]:
        # Position i: (fc(aux_i), x_{i+1}) -> o_i, whose logits should be the target's at i + 1
        # (its distribution of x_{i+2}). As EAGLE-3 trains: token loss only, no feature
        # regression. Unrolled step s feeds back the step s-1 outputs o (already H wide: no fc).
        mask, answer = b.mask[:, 1:], b.answer[:, 1:]
        teacher_all = self.teacher(b.hidden[:, 1:])  # [B, T - 1, reduced]
        features = self.module.fc(b.aux[:, :-1])
        total, metrics = 0.0, {}
        for step in range(self.options.unroll):
            width = features.shape[1]
            embeds = self.embed[b.tokens[:, step + 1: step + 1 + width]]
            output = self.module(embeds, features, torch.arange(width))
            student = self.module.logits(output)
            teacher, m = teacher_all[:, step: step + width], mask[:, step: step + width]
            total = total + distill_loss(student, teacher, self.options.loss, m)
            metrics.update(agreement(f"top1_step{step + 1}", student, teacher, m,
                                     answer[:, step: step + width]))
            features = output[:, :-1]  # o_i, paired next with x_{i+2}
        metrics["loss"] = float(total.detach())
        return total, metrics

    def _block_outputs(self, b: Batch, anchors: torch.Tensor) -> torch.Tensor:
        """The block drafter's normed outputs for blocks at `anchors` [B, A] (positions of the
        newest token, each >= 1): [B, A, block, hidden]. The block at anchor a holds x_a then
        block - 1 mask slots at positions a..a+block-1; it sees the context features at
        positions < a and its own rows up to itself (causal), as while drafting."""
        net = self.module
        batch, count = anchors.shape
        size, width = net.block, b.tokens.shape[1]
        embeds = torch.cat([self.embed[b.tokens.gather(1, anchors)][:, :, None],
                            net.mask.expand(batch, count, size - 1, -1)], 2)  # [B, A, block, hidden]
        context = net.context(torch.cat([b.hidden, b.aux], -1))  # [B, T, hidden]
        newest = context.gather(1, (anchors - 1)[..., None].expand(-1, -1, context.shape[-1]))
        rows = net.rows(embeds, newest[:, :, None].expand_as(embeds))  # [B, A, block, hidden]
        positions = (anchors[:, :, None] + torch.arange(size)).view(batch, -1)  # [B, A * block]
        row_anchor = anchors.repeat_interleave(size, dim=1)  # [B, A * block]
        sees_context = torch.arange(width) < row_anchor[:, :, None]  # [B, A * block, T]
        own_block = torch.block_diag(*[torch.ones(size, size, dtype=torch.bool).tril()] * count)
        mask = torch.cat([sees_context, own_block.expand(batch, -1, -1)], -1)[:, None]
        return net(rows.reshape(batch, count * size, -1), positions, context, mask).view(
            batch, count, size, -1)

    def _block(self, b: Batch) -> tuple[torch.Tensor, dict]:
        # Anchors: BLOCK_ANCHORS random answer positions a >= 1 of each sequence (the newest
        # committed token while drafting); a seeded draw while evaluating. Slot j of the block
        # at a drafts x_{a+j}: its teacher is the target's distribution at a + j - 1 (token
        # loss only: EAGLE's feature regression beside it made no difference in a 100-step
        # trial, docs/training.md). Slot j's loss weighs exp(-(j - 1) / (block / 2)) (DFlash's
        # decay): a draft is kept only up to its first miss, so the first slots matter most.
        size = self.module.block
        batch, width = b.tokens.shape
        generator = None if self.module.training else torch.Generator().manual_seed(0)
        candidates = b.answer & b.mask
        candidates[:, 0] = False
        scores = torch.rand(batch, width, generator=generator).masked_fill(~candidates, -1.0)
        anchors = scores.topk(min(BLOCK_ANCHORS, width), dim=1).indices  # [B, A]
        valid = candidates.gather(1, anchors)  # fewer candidates than anchors: the rest are off
        anchors = anchors.clamp_min(1)
        outputs = self._block_outputs(b, anchors)  # [B, A, block, hidden]
        lengths = b.mask.sum(1, keepdim=True)  # [B, 1]
        total, weights, metrics = 0.0, 0.0, {}
        for j in range(1, size):
            taught = anchors + j - 1  # [B, A]
            real = valid & (taught < lengths)
            teacher = self.teacher(b.hidden.gather(1, taught.clamp_max(width - 1)[..., None]
                                                   .expand(-1, -1, b.hidden.shape[-1])))
            student = self.teacher(outputs[:, :, j])
            weight = math.exp(-(j - 1) / (size / 2))
            total = total + weight * distill_loss(student, teacher, self.options.loss, real)
            weights += weight
            metrics.update(agreement(f"top1_slot{j}", student, teacher, real, real))
        total = total / weights
        metrics["loss"] = float(total.detach())
        return total, metrics

    def _block_features(self, b: Batch) -> torch.Tensor:
        """The block drafter's slots with the newest token at i + 1, for every position i (the
        index a head reading the target's state at i has): [B, T, block - 1, hidden]; in chunks
        of BLOCK_ANCHORS anchors, as training runs them."""
        batch, width = b.tokens.shape
        anchors = torch.arange(1, width + 1).clamp_max(width - 1).expand(batch, -1)
        return torch.cat([self._block_outputs(b, anchors[:, start: start + BLOCK_ANCHORS])[:, :, 1:]
                          for start in range(0, width, BLOCK_ANCHORS)], 1)

    def _head_term(self, k: int, student: torch.Tensor, teacher_all: torch.Tensor,
                   b: Batch) -> tuple[torch.Tensor, dict]:
        """Loss and agreement of head k, whose prediction at t is the target's at t + k.
        student: [B, T - k, reduced]; teacher_all: [B, T, reduced]."""
        teacher, m = teacher_all[:, k:], b.mask[:, k:]
        return (distill_loss(student, teacher, self.options.loss, m),
                agreement(f"top1_head{k}", student, teacher, m, b.answer[:, k:]))

    def _medusa(self, b: Batch) -> tuple[torch.Tensor, dict]:
        # Head k on h_i predicts x_{i+1+k}: its teacher is the target's distribution at i + k.
        features = self.module(b.hidden)  # [B, T, heads, hidden]
        teacher_all = self.teacher(b.hidden)  # [B, T, reduced], computed once for every head
        total, metrics = 0.0, {}
        for k in range(1, self.module.num_heads + 1):
            loss, agree = self._head_term(k, self.teacher(features[:, :-k, k - 1]), teacher_all, b)
            total = total + loss
            metrics.update(agree)
        metrics["loss"] = float(total.detach())
        return total, metrics

    def _hydra(self, b: Batch) -> tuple[torch.Tensor, dict]:
        # Head k on h_i reads x_{i+1}..x_{i+k} (the data's own tokens: teacher forcing) and
        # predicts x_{i+1+k}: its teacher is the target's distribution at i + k.
        embeds = self.embed[b.tokens]  # [B, T, hidden]
        teacher_all = self.teacher(b.hidden)  # [B, T, reduced]
        total, metrics = 0.0, {}
        for k in range(1, self.module.num_heads + 1):
            width = max(0, b.tokens.shape[1] - k)
            inputs = torch.cat([b.hidden[:, :width], *(embeds[:, j: j + width] for j in range(1, k + 1))],
                               dim=-1)  # [B, T - k, (k + 1) * hidden]
            loss, agree = self._head_term(k, self.teacher(self.module.head(inputs)), teacher_all, b)
            total = total + loss
            metrics.update(agree)
        metrics["loss"] = float(total.detach())
        return total, metrics

    def mtp_head_losses(self, b: Batch) -> tuple[list[Callable[[torch.Tensor], torch.Tensor]], dict]:
        """MTP: one loss function per head of the trunk's output [B, T, hidden] (the target's
        final states), and the metrics dict they fill in as they run. Head k reads the states up
        to i and predicts x_{i+1+k}: its teacher is the target's distribution at i + k."""
        positions = torch.arange(b.tokens.shape[1])
        teacher_all = self.teacher(b.hidden)  # [B, T, reduced]
        metrics: dict = {}

        def head_loss(k: int) -> Callable[[torch.Tensor], torch.Tensor]:
            def loss(trunk: torch.Tensor) -> torch.Tensor:
                output = self.module.layers[k - 1](trunk, positions)[:, :-k]  # [B, T - k, hidden]
                value, agree = self._head_term(k, self.teacher(self.norm(output)), teacher_all, b)
                metrics.update(agree)
                return value
            return loss

        return [head_loss(k) for k in range(1, self.module.num_heads + 1)], metrics

    def _mtp(self, b: Batch) -> tuple[torch.Tensor | None, dict]:
        # With gradients on: backward head by head, here (the trainer gets None to skip its own).
        losses, metrics = self.mtp_head_losses(b)
        if torch.is_grad_enabled():
            total, _ = multi_head_backward(b.hidden, losses)
            return None, {**metrics, "loss": float(total)}
        total = sum(loss(b.hidden) for loss in losses)
        return total, {**metrics, "loss": float(total)}

    def _exit(self, b: Batch) -> tuple[torch.Tensor, dict]:
        student = self.teacher(self.module(b.exit_hidden))
        teacher = self.teacher(b.hidden)
        loss = distill_loss(student, teacher, self.options.loss, b.mask)
        return loss, {"loss": float(loss.detach()), **agreement("top1", student, teacher, b.mask, b.answer)}

    def _draft(self, b: Batch) -> tuple[torch.Tensor, dict]:
        student = self.teacher(self.module(b.tokens))
        teacher = self.teacher(b.hidden)
        loss = distill_loss(student, teacher, self.options.loss, b.mask)
        return loss, {"loss": float(loss.detach()), **agreement("top1", student, teacher, b.mask, b.answer)}

    def _medusa_features(self, b: Batch) -> torch.Tensor:
        """Medusa's features of every head at every position, before the LM head:
        [B, T, heads, hidden]."""
        return self.module(b.hidden)

    def _mtp_features(self, b: Batch) -> torch.Tensor:
        """MTP's features of every head at every position, normed: [B, T, heads, hidden]."""
        return self.norm(self.module(b.hidden, torch.arange(b.tokens.shape[1])))

    @torch.no_grad()
    def rank_accuracy(self, items: list[Sequence], max_len: int, ranks: int = 8,
                      chunk: int = 8) -> list[list[float]]:
        """Medusa, MTP: [head][r], how often head k's r-th most probable token is the target's
        own choice k positions on, over the given (held-out) sequences; shapes the static tree."""
        hits = torch.zeros(self.module.num_heads, ranks)
        counts = torch.zeros(self.module.num_heads)
        for start in range(0, len(items), chunk):
            b = collate(items[start: start + chunk], max_len)
            features = self.spec.head_features(self, b)  # [B, T, heads, hidden]
            target_top = self.teacher(b.hidden).argmax(-1)  # [B, T]
            for k in range(1, self.module.num_heads + 1):
                ranked = self.teacher(features[:, :-k, k - 1]).topk(ranks, dim=-1).indices
                m = b.mask[:, k:]
                hits[k - 1] += (ranked == target_top[:, k:, None])[m].sum(0)
                counts[k - 1] += m.sum()
        return (hits / counts.clamp_min(1)[:, None]).tolist()

    def export(self, out_dir: Path, extra: dict) -> Path:
        weights = {self.spec.prefix + k: v for k, v in self.module.state_dict().items()}
        if self.spec.reduced_vocab:
            weights["vocab_ids"] = self.vocab_ids
        return save_drafter(out_dir, self.kind, self.target,
                            {k: v for k, v in self.settings.items()}, weights, extra)


Built = tuple[dict, nn.Module]  # a kind's settings (drafter.json) and its trainable module


def _eagle_module(recipe: Recipe, meta: dict, sequences: list[Sequence]) -> Built:
    settings = eagle_settings(recipe.target)
    if recipe.options.mid_state:
        settings["mid_layer"] = int(meta["exit_layer"])
    return settings, EagleNet(**settings)


def _require_aux(meta: dict, sequences: list[Sequence], who: str) -> None:
    if "aux_layers" not in meta or any(s.aux_hidden is None for s in sequences):
        raise VerispecError(f"{who} trains on the target's states after its aux layers: this "
                            "data has none (`verispec train eagle3` and `verispec train block` "
                            "build data with them; use a new --data directory)")


def _eagle3_module(recipe: Recipe, meta: dict, sequences: list[Sequence]) -> Built:
    _require_aux(meta, sequences, "EAGLE-3")
    settings = eagle3_settings(recipe.target, tuple(meta["aux_layers"]), len(recipe.vocab_ids))
    module = Eagle3Net(**settings)
    with torch.no_grad():  # the target's own head, restricted: a good place to start
        module.lm_head.weight.copy_(recipe.head_t.t())
    module.lm_head.weight.requires_grad_(recipe.options.train_head)
    return settings, module


def _block_module(recipe: Recipe, meta: dict, sequences: list[Sequence]) -> Built:
    _require_aux(meta, sequences, "a block drafter")
    options = recipe.options
    settings = block_settings(recipe.target, tuple(meta["aux_layers"]), options.draft_layers,
                              options.block)
    module = BlockNet(**settings)
    with torch.no_grad():  # the target's final norm: its LM head reads states at that scale
        module.norm.weight.copy_(unembedding_norm(recipe.target).weight)
    return settings, module


def _draft_module(recipe: Recipe, meta: dict, sequences: list[Sequence]) -> Built:
    layers = recipe.options.draft_layers
    return draft_settings(layers), DraftStudent(recipe.target, layers).float()


def _medusa_module(recipe: Recipe, meta: dict, sequences: list[Sequence]) -> Built:
    settings = medusa_settings(recipe.target, recipe.options.heads)
    return settings, MedusaNet(**settings)


def _hydra_module(recipe: Recipe, meta: dict, sequences: list[Sequence]) -> Built:
    settings = hydra_settings(recipe.target, recipe.options.heads)
    return settings, HydraNet(**settings)


def _mtp_module(recipe: Recipe, meta: dict, sequences: list[Sequence]) -> Built:
    settings = mtp_settings(recipe.target, recipe.options.heads)
    recipe.norm = unembedding_norm(recipe.target)
    return settings, MTPNet(**settings)


def _exit_module(recipe: Recipe, meta: dict, sequences: list[Sequence]) -> Built:
    exit_layer = recipe.options.exit_layer
    layer = meta["exit_layer"] if exit_layer is None else exit_layer
    if layer != meta["exit_layer"]:
        raise VerispecError(f"the data holds layer {meta['exit_layer']} states, not layer "
                            f"{layer}: rebuild it with that exit layer")
    settings = exit_settings(recipe.target, layer)
    return settings, new_adapter(recipe.target, settings)


@dataclass(frozen=True)
class KindRecipe:
    """How one drafter kind trains: everything the recipe, `verispec train` and the export ask."""

    build: Callable[[Recipe, dict, list[Sequence]], Built]  # (recipe so far, data meta, data)
    loss: Callable[[Recipe, Batch], tuple[torch.Tensor | None, dict]]
    prefix: str = "net."  # key prefix of the kind's own weights in weights.safetensors
    # Drafts through the target's LM head restricted to its own vocabulary (vocab_ids, exported)
    reduced_vocab: bool = True
    # Static-tree kinds (heads that read only the target's states): every head's features at
    # every position [B, T, heads, hidden], whose measured rank accuracy shapes the tree
    head_features: Callable[[Recipe, Batch], torch.Tensor] | None = None
    reads_aux: bool = False  # trains on the target's states after its aux layers (EAGLE-3)
    own_head: bool = False  # its own head's rows are its vocabulary's: a warm start keeps both
    mid_state: bool = False  # can also read the target's state at the exit layer (--mid-state)

    @property
    def static_tree(self) -> bool:
        return self.head_features is not None


# Every kind `verispec train` knows, keyed by its drafter's own `kind` (the order of the help text).
RECIPES: dict[str, KindRecipe] = {
    EagleDrafter.kind: KindRecipe(_eagle_module, Recipe._eagle, mid_state=True),
    MedusaDrafter.kind: KindRecipe(_medusa_module, Recipe._medusa,
                                   head_features=Recipe._medusa_features),
    ExitAdapter.kind: KindRecipe(_exit_module, Recipe._exit, "adapter.", reduced_vocab=False),
    DraftStudent.kind: KindRecipe(_draft_module, Recipe._draft, "student.", reduced_vocab=False),
    Eagle3Drafter.kind: KindRecipe(_eagle3_module, Recipe._eagle3, reads_aux=True, own_head=True),
    HydraDrafter.kind: KindRecipe(_hydra_module, Recipe._hydra),
    MTPDrafter.kind: KindRecipe(_mtp_module, Recipe._mtp, head_features=Recipe._mtp_features),
    BlockDrafter.kind: KindRecipe(_block_module, Recipe._block, head_features=Recipe._block_features,
                                  reads_aux=True),
}
KINDS = tuple(RECIPES)


def split(sequences: list[Sequence], seed: int,
          eval_fraction: float) -> tuple[list[Sequence], list[Sequence]]:
    """(training, held-out) sequences: a seeded shuffle, the first eval_fraction held out."""
    order = list(range(len(sequences)))
    random.Random(seed).shuffle(order)
    held = max(1, int(len(order) * eval_fraction)) if len(order) > 1 else 0
    eval_items = [sequences[i] for i in order[:held]]
    return [sequences[i] for i in order[held:]] or eval_items, eval_items


def calibrate_medusa(drafter_dir: Path, target: LoadedModel, data_dir: Path,
                     eval_fraction: float = 0.05) -> list[list[float]]:
    """Measure a trained Medusa drafter's rank accuracies on its training run's held-out data and
    store them in its drafter.json (for drafters trained before verispec measured them itself)."""
    config = drafter_config(drafter_dir)
    kind = MedusaDrafter.kind
    _, weights = load_drafter(drafter_dir, target.model, kind)
    meta, sequences = load_dataset(data_dir)
    recipe = Recipe(kind, target, meta, sequences, RecipeOptions(heads=config["settings"]["heads"]))
    prefix = RECIPES[kind].prefix
    recipe.module.load_state_dict({k.removeprefix(prefix): v.float() for k, v in weights.items()
                                   if k.startswith(prefix)})
    recipe.head = ReducedHead(target.model, weights["vocab_ids"].long())
    recipe.head_t = recipe.head.weight_t.float()
    train_config = config["training"]["config"]
    _, eval_items = split(sequences, train_config["seed"], eval_fraction)
    config["rank_accuracy"] = recipe.rank_accuracy(eval_items, train_config["max_len"])
    (Path(drafter_dir) / CONFIG_FILE).write_text(json.dumps(config, indent=1) + "\n")
    return config["rank_accuracy"]


def load_datasets(data_dirs: list[Path], target: LoadedModel) -> tuple[dict, list[Sequence]]:
    """The sequences of every data directory, checked to be the target's states at one exit
    layer. The metadata returned is the first directory's, with a "sources" list of them all."""
    metas, sequences = [], []
    for data_dir in data_dirs:
        meta, found = load_dataset(data_dir)
        if meta.get("hidden_size") != target.model.config.get_text_config(decoder=True).hidden_size:
            raise VerispecError(f"the data in {data_dir} was made for another target")
        if metas and meta["exit_layer"] != metas[0]["exit_layer"]:
            raise VerispecError(f"the data in {data_dir} holds layer {meta['exit_layer']} states, "
                                f"the data in {data_dirs[0]} layer {metas[0]['exit_layer']}")
        metas.append(meta)
        sequences += found
    return ({**metas[0], "sources": metas} if len(metas) > 1 else metas[0]), sequences


def train_drafter(kind: str, target: LoadedModel, data_dirs: list[Path], out_dir: Path,
                  config: TrainConfig, options: RecipeOptions = RecipeOptions(),
                  eval_fraction: float = 0.05) -> Path:
    """Train a drafter of `kind` on the data in data_dirs (self-distillation and corpus data
    mixed); write it (and its run files) to out_dir."""
    if config.bf16 is None:  # recorded as decided
        config = replace(config, bf16=bf16_is_fast(target.model.device.type))
    meta, sequences = load_datasets(data_dirs, target)
    torch.manual_seed(config.seed)
    recipe = Recipe(kind, target, meta, sequences, options)
    train_items, eval_items = split(sequences, config.seed, eval_fraction)
    history = train(recipe.module, lambda batch: recipe.loss(batch, config.max_len), train_items,
                    eval_items, config, out_dir / "run", desc=f"train {kind}")
    final_eval = {k: v for k, v in history[-1].items() if k.startswith("eval_")}
    extra = {"training": {"data": meta, "sequences": len(sequences), "config": asdict(config),
                          "options": asdict(options), "final_eval": final_eval}}
    if RECIPES[kind].static_tree:
        extra["rank_accuracy"] = recipe.rank_accuracy(eval_items, config.max_len)
    return recipe.export(out_dir, extra)
