"""Early-exit self-speculation (LayerSkip): the target's first L layers draft for the full model.

The drafter is a second module that *shares* the target's embedding, first L decoder layers,
final norm and LM head: no weights are copied and the target's config is never modified.
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING

import torch

from verispec.core.errors import VerispecError
from verispec.core.tree import TreeSettings
from verispec.drafters.model import ModelDrafter
from verispec.model.packed import per_target

if TYPE_CHECKING:
    from transformers import PreTrainedModel


def decoder_layers(model: PreTrainedModel) -> torch.nn.ModuleList:
    """The decoder layer stack of a Hugging Face causal LM (model.model.layers)."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    if not isinstance(layers, torch.nn.ModuleList):
        raise VerispecError(
            f"early exit needs a decoder with model.model.layers; {type(model).__name__} has none")
    return layers


def default_exit_layer(target: PreTrainedModel) -> int:
    """Half the target's depth: the one place this default is defined."""
    return len(decoder_layers(target)) // 2


def early_exit_model(target: PreTrainedModel, num_layers: int) -> PreTrainedModel:
    """A model of the same class whose forward runs only the target's first num_layers layers."""
    layers = decoder_layers(target)
    if not 1 <= num_layers < len(layers):
        raise VerispecError(
            f"exit layer must be between 1 and {len(layers) - 1} for this {len(layers)}-layer "
            f"target, got {num_layers}")
    config = copy.deepcopy(target.config)
    config.num_hidden_layers = num_layers
    if getattr(config, "layer_types", None) is not None:
        config.layer_types = config.layer_types[:num_layers]
    with torch.device("meta"):
        shallow = type(target)(config)
    # Every submodule of the shallow model is replaced by the target's own (shared weights).
    for name, child in target.model.named_children():
        setattr(shallow.model, name, child)
    shallow.model.layers = torch.nn.ModuleList(layers[:num_layers])
    for name, child in target.named_children():
        if name != "model":
            setattr(shallow, name, child)
    leftover = [n for n, t in [*shallow.named_parameters(), *shallow.named_buffers()] if t.is_meta]
    if leftover:
        raise VerispecError(f"cannot build an early-exit view of {type(target).__name__}: "
                            f"{leftover[0]} is not shared with the target")
    shallow.eval()
    return shallow


def early_exit_drafter(target: PreTrainedModel, num_layers: int, vocab_size: int,
                       confidence_threshold: float | None = None,
                       tree: TreeSettings | None = None) -> ModelDrafter:
    """A ModelDrafter over the target's first num_layers layers (one view per depth, shared)."""
    view = per_target(target, ("first layers", num_layers), lambda: early_exit_model(target, num_layers))
    return ModelDrafter(view, vocab_size, confidence_threshold, tree)
