"""Early exit with a trained exit: the target's first L layers, then a small learned adapter.

The untrained exit reads layer L's hidden state through the target's final norm and LM head,
which were made for layer N's states, so it rarely agrees with the full model. A trained exit
inserts a residual adapter and its own norm before the (shared, frozen) LM head, fitted to the
full model's next-token distribution.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from verispec.core.tree import TreeSettings
from verispec.drafters.early_exit import early_exit_model
from verispec.drafters.learned import drafter_files, load_drafter
from verispec.drafters.model import ModelDrafter
from verispec.drafters.nn import ResBlock, RMSNorm
from verispec.model.packed import per_target

if TYPE_CHECKING:
    from transformers import PreTrainedModel


class ExitAdapter(nn.Module):
    """Layer-L hidden state [..., hidden] -> a state the target's LM head can read."""

    kind = "early-exit"  # the trained drafter kind whose weights this module holds

    def __init__(self, hidden: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.adapt = ResBlock(hidden)
        self.norm = RMSNorm(hidden, eps)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.norm(self.adapt(hidden))


def exit_settings(target: PreTrainedModel, exit_layer: int) -> dict:
    config = target.config.get_text_config(decoder=True)
    return {"hidden": int(config.hidden_size), "eps": float(getattr(config, "rms_norm_eps", 1e-5)),
            "exit_layer": exit_layer}


def new_adapter(target: PreTrainedModel, settings: dict) -> ExitAdapter:
    """An adapter that starts as the untrained exit: identity block, the target's final norm."""
    adapter = ExitAdapter(settings["hidden"], settings["eps"])
    final_norm = getattr(target.model, "norm", None)
    if final_norm is not None and getattr(final_norm, "weight", None) is not None:
        adapter.norm.weight.data.copy_(final_norm.weight.detach().float())
    return adapter


def trained_exit_drafter(path: str | Path, target: PreTrainedModel, vocab_size: int,
                         confidence_threshold: float | None = None,
                         tree: TreeSettings | None = None) -> ModelDrafter:
    """A ModelDrafter over the target's first L layers whose final norm is the trained exit."""
    config, weights = load_drafter(path, target, ExitAdapter.kind)
    settings = config["settings"]

    def view() -> PreTrainedModel:
        adapter = ExitAdapter(settings["hidden"], settings["eps"])
        adapter.load_state_dict({k.removeprefix("adapter."): v for k, v in weights.items()})
        shallow = early_exit_model(target, settings["exit_layer"])
        # Only the shallow view's norm changes; the target keeps its own.
        shallow.model.norm = adapter.to(device=target.device, dtype=target.dtype).eval()
        return shallow

    directory, version = drafter_files(path)  # load_drafter read them: they are there
    # one view per drafter file as it is now, shared by the drafters built from it
    drafter = ModelDrafter(per_target(target, ("trained-exit", directory), view, version), vocab_size,
                           confidence_threshold, tree)
    drafter.exit_layer = settings["exit_layer"]
    return drafter
