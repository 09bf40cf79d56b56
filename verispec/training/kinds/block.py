"""The block drafter: a few decoder layers over the target's context features that draft a whole
block (the newest token, then block - 1 mask slots) in one pass, trained DFlash-style."""

from __future__ import annotations

import math

import torch

from verispec.drafters.block import BlockDrafter, BlockNet, block_settings
from verispec.drafters.mtp import unembedding_norm
from verispec.training.data import Sequence
from verispec.training.losses import agreement_rates, head_distillation
from verispec.training.shell import Batch, Built, Kind, Recipe, require_aux

# Blocks trained per sequence per step (random answer positions as the newest token)
ANCHORS = 32


def build(recipe: Recipe, meta: dict, sequences: list[Sequence]) -> Built:
    require_aux(meta, sequences, "a block drafter")
    options = recipe.options
    settings = block_settings(recipe.target, tuple(meta["aux_layers"]), options.draft_layers,
                              options.block)
    module = BlockNet(**settings)
    with torch.no_grad():  # the target's final norm: its LM head reads states at that scale
        module.norm.weight.copy_(unembedding_norm(recipe.target).weight)
    return settings, module


def block_outputs(recipe: Recipe, b: Batch, anchors: torch.Tensor) -> torch.Tensor:
    """The block drafter's normed outputs for blocks at `anchors` [B, A] (positions of the
    newest token, each >= 1): [B, A, block, hidden]. The block at anchor a holds x_a then
    block - 1 mask slots at positions a..a+block-1; it sees the context features at
    positions < a and its own rows up to itself (causal), as while drafting."""
    net = recipe.module
    batch, count = anchors.shape
    size, width = net.block, b.tokens.shape[1]
    embeds = torch.cat([recipe.embed[b.tokens.gather(1, anchors)][:, :, None],
                        net.mask.expand(batch, count, size - 1, -1)], 2)  # [B, A, block, hidden]
    context = net.context(torch.cat([b.hidden, b.aux], -1))  # [B, T, hidden]
    newest = context.gather(1, (anchors - 1)[..., None].expand(-1, -1, context.shape[-1]))
    rows = net.rows(embeds, newest[:, :, None].expand_as(embeds))  # [B, A, block, hidden]
    device = anchors.device
    positions = (anchors[:, :, None] + torch.arange(size, device=device)).view(batch, -1)  # [B, A * block]
    row_anchor = anchors.repeat_interleave(size, dim=1)  # [B, A * block]
    sees_context = torch.arange(width, device=device) < row_anchor[:, :, None]  # [B, A * block, T]
    own_block = torch.block_diag(*[torch.ones(size, size, dtype=torch.bool, device=device).tril()] * count)
    mask = torch.cat([sees_context, own_block.expand(batch, -1, -1)], -1)[:, None]
    return net(rows.reshape(batch, count * size, -1), positions, context, mask).view(
        batch, count, size, -1)


def loss(recipe: Recipe, b: Batch) -> tuple[torch.Tensor, dict]:
    # Anchors: ANCHORS random answer positions a >= 1 of each sequence (the newest committed
    # token while drafting); a seeded draw while evaluating. Slot j of the block at a drafts
    # x_{a+j}: its teacher is the target's distribution at a + j - 1 (token loss only: EAGLE's
    # feature regression beside it made no difference in a 100-step trial, docs/training.md).
    # Slot j's loss weighs exp(-(j - 1) / (block / 2)) (DFlash's decay): a draft is kept only
    # up to its first miss, so the first slots matter most.
    size = recipe.module.block
    batch, width = b.tokens.shape
    generator = None if recipe.module.training else torch.Generator().manual_seed(0)
    candidates = b.answer & b.mask
    candidates[:, 0] = False
    # drawn on the CPU (its generator, or the global seed the trainer sets) on any device
    scores = torch.rand(batch, width, generator=generator, device="cpu").to(b.mask.device)
    scores = scores.masked_fill(~candidates, -1.0)
    anchors = scores.topk(min(ANCHORS, width), dim=1).indices  # [B, A]
    valid = candidates.gather(1, anchors)  # fewer candidates than anchors: the rest are off
    anchors = anchors.clamp_min(1)
    outputs = block_outputs(recipe, b, anchors)  # [B, A, block, hidden]
    lengths = b.mask.sum(1, keepdim=True)  # [B, 1]
    total, weights, metrics = 0.0, 0.0, {}
    for j in range(1, size):
        taught = anchors + j - 1  # [B, A]
        real = valid & (taught < lengths)
        teacher = b.hidden.gather(1, taught.clamp_max(width - 1)[..., None]
                                  .expand(-1, -1, b.hidden.shape[-1]))  # [B, A, hidden]
        tokens, same = head_distillation(outputs[:, :, j][real], teacher[real], recipe.head_t,
                                         recipe.options.loss)
        weight = math.exp(-(j - 1) / (size / 2))
        total = total + weight * tokens
        weights += weight
        metrics.update(agreement_rates(f"top1_slot{j}", same, torch.ones_like(same)))
    total = total / weights
    metrics["loss"] = float(total.detach())
    return total, metrics


def features(recipe: Recipe, b: Batch) -> torch.Tensor:
    """The slots with the newest token at i + 1, for every position i (the index a head reading
    the target's state at i has): [B, T, block - 1, hidden]; in chunks of ANCHORS anchors, as
    training runs them."""
    batch, width = b.tokens.shape
    anchors = torch.arange(1, width + 1, device=b.tokens.device).clamp_max(width - 1).expand(batch, -1)
    return torch.cat([block_outputs(recipe, b, anchors[:, start: start + ANCHORS])[:, :, 1:]
                      for start in range(0, width, ANCHORS)], 1)


KIND = Kind(BlockDrafter.kind, build, loss, frozenset({"draft_layers", "block"}),
            head_features=features, reads_aux=True)
