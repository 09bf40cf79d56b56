"""A distilled draft model: a few layers of the target's own architecture, trained to match it.

The student has its own first `num_layers` decoder layers (initialised as copies of the
target's) and its own final norm; it borrows the target's embedding and LM head, frozen and
never copied. It drafts like any independent draft model (ModelDrafter), with the target's
tokenizer by construction.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from verispec.core.tree import TreeSettings
from verispec.drafters.early_exit import early_exit_model
from verispec.drafters.learned import drafter_files, load_drafter
from verispec.drafters.model import ModelDrafter
from verispec.model.lowbit import QuantLinear
from verispec.model.packed import per_target

if TYPE_CHECKING:
    from transformers import PreTrainedModel


class DraftStudent(nn.Module):
    """The student's own weights (layers + norm); `lm` is the runnable model that uses them.

    lm shares the target's embedding and head, which are kept out of this module's parameters
    so that training and saving touch only the student's own weights.
    """

    kind = "draft"  # the trained drafter kind whose weights this module holds

    def __init__(self, target: PreTrainedModel, num_layers: int) -> None:
        super().__init__()
        shallow = early_exit_model(target, num_layers)
        self.layers = float_linears(copy.deepcopy(shallow.model.layers))
        self.norm = copy.deepcopy(shallow.model.norm)
        shallow.model.layers, shallow.model.norm = self.layers, self.norm
        self._lm = [shallow]  # a list: not registered as a submodule

    @property
    def lm(self) -> PreTrainedModel:
        return self._lm[0]

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens [batch, T] -> final hidden states [batch, T, hidden] (right padding is harmless)."""
        return self.lm.model(input_ids=tokens, use_cache=False).last_hidden_state


def float_linears(module: nn.Module) -> nn.Module:
    """`module` with every low-precision layer (a 4-bit target's QuantLinear) replaced by an
    nn.Linear holding the float32 weights it stands for: the student's own weights are float
    (trained and saved so), whatever the target it borrows its embedding and head from runs in."""
    for name, child in list(module.named_modules()):
        if isinstance(child, QuantLinear):
            linear = nn.Linear(child.in_features, child.out_features, bias=child.bias is not None)
            linear.weight.data = child.weight.float()
            if child.bias is not None:
                linear.bias.data = child.bias.float()
            parent, _, leaf = name.rpartition(".")
            setattr(module.get_submodule(parent), leaf, linear)
    return module


def draft_settings(num_layers: int = 2) -> dict:
    return {"num_layers": num_layers}


def distilled_drafter(path: str | Path, target: PreTrainedModel, vocab_size: int,
                      confidence_threshold: float | None = None,
                      tree: TreeSettings | None = None) -> ModelDrafter:
    def read() -> PreTrainedModel:
        config, weights = load_drafter(path, target, DraftStudent.kind)
        student = DraftStudent(target, config["settings"]["num_layers"])
        student.load_state_dict({k.removeprefix("student."): v for k, v in weights.items()})
        return student.to(device=target.device, dtype=target.dtype).eval().lm

    files = drafter_files(path)
    if files is None:
        return ModelDrafter(read(), vocab_size, confidence_threshold, tree)  # read() says what is wrong
    directory, version = files  # read once per file as it is, shared by the drafters built from it
    return ModelDrafter(per_target(target, ("student", directory), read, version), vocab_size,
                        confidence_threshold, tree)
