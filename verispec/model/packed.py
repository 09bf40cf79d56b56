"""CPU inference with linear-layer weights prepacked once for oneDNN, instead of on every call.

`F.linear` on CPU hands each call to a GEMM that lays the weight out in its blocked format
again, so a product over several rows reads the weight twice. A verification pass multiplies
every weight by a block of 4-16 rows, and that repacking is what made it cost up to twice a
one-token step (figures: docs/performance.md, "Prepacked weights"). Prepacked
products are also independent of the number of rows (each row's result is bit-identical whether
it is multiplied alone or in a block), which `F.linear` is not.

Targets and drafter networks (EAGLE) run this way. The packed model is a view: a copy of the
module tree whose `nn.Linear` modules are replaced by `PackedLinear`, sharing every other tensor
with the original, which stays untouched (Hugging Face baselines run on it). The packed weights
cost one extra copy of the linear weights.
"""

from __future__ import annotations

import copy
import functools
import weakref
from collections.abc import Callable, Hashable
from typing import TypeVar

import torch
from torch import nn

# Block height the packed layout is tuned for: a typical verification block (4-16 rows all run
# within a few percent of the best layout for each: docs/performance.md).
PACK_ROWS = 8
PACKABLE_DTYPES = (torch.float32, torch.bfloat16)
Module = TypeVar("Module", bound=nn.Module)
T = TypeVar("T")

# model -> (fingerprint of its linear weights, packed view): engines built per call share a view;
# a replaced or in-place-changed weight renews it.
_VIEWS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class PackedLinear(nn.Module):
    """nn.Linear with its weight prepacked for oneDNN. Keeps the original weight (shared, not
    copied) for code that reads `.weight`."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = linear.weight, linear.bias
        self.packed = pack_weight(linear.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [..., in_features] -> [..., out_features]
        return packed_linear(x, self.packed, self.bias)


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """weight [out_features, in_features] in oneDNN's blocked layout (a new tensor)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACK_ROWS)


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [..., in_features] @ the packed weight's transpose (+ bias) -> [..., out_features]."""
    bias = None if bias is None else bias.detach()
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def can_pack(model: nn.Module) -> bool:
    """Whether `model`'s linear layers can run prepacked: on CPU, in float32 or bfloat16, with
    oneDNN available in this torch build."""
    parameter = next(model.parameters(), None)
    return (parameter is not None and parameter.device.type == "cpu"
            and parameter.dtype in PACKABLE_DTYPES and cpu_packs(parameter.dtype))


@functools.cache
def cpu_packs(dtype: torch.dtype) -> bool:
    """Whether this torch build and CPU pack weights of `dtype`: oneDNN's bfloat16 path needs
    AVX512BW/VL/DQ or AVX-NE-CONVERT, which some CPUs (this project's AMD machines) lack."""
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")):
        return False
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(8, 8, dtype=dtype), PACK_ROWS)
    except RuntimeError:
        return False
    return True


def linear_fingerprint(model: nn.Module) -> tuple:
    """Identity and version of every linear weight (a 4-bit layer's: its kernel's): changes when
    one is replaced or edited."""
    found = []
    for m in model.modules():
        if isinstance(m, nn.Linear):
            found.append((id(m.weight), m.weight._version))
        elif hasattr(m, "stored"):  # lowbit.QuantLinear: its weights live in its kernel
            found.append((id(m.kernel), 0))
    return tuple(found)


def replace_linears(module: nn.Module, replace: Callable[[nn.Linear], nn.Module]) -> nn.Module:
    """A shallow copy of `module` with fresh child dictionaries, each linear layer `replace`d (a
    view: parameters and buffers shared, `module` untouched)."""
    if isinstance(module, nn.Linear):
        return replace(module)
    clone = copy.copy(module)  # shares parameters and buffers
    clone._modules = {name: None if child is None else replace_linears(child, replace)
                      for name, child in module._modules.items()}
    return clone


def packed_view(model: Module) -> Module:
    """`model` (a target, or a drafter's network) with prepacked linear layers where `can_pack`
    allows it, else `model` itself."""
    if not can_pack(model):
        return model
    return per_model(_VIEWS, model, functools.partial(replace_linears, replace=PackedLinear))


def per_model(cache: weakref.WeakKeyDictionary, model: nn.Module, build: Callable[[nn.Module], T]) -> T:
    """build(model), made once per model and kept in `cache` (engines built per call share it);
    made again when a linear weight of the model was replaced or changed in place."""
    fingerprint = linear_fingerprint(model)
    cached = cache.get(model)
    if cached is None or cached[0] != fingerprint:
        cached = (fingerprint, build(model))
        cache[model] = cached
    return cached[1]


# target -> {slot: (version, what was made for it)}
_PER_TARGET: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def per_target(target: nn.Module, slot: Hashable, make: Callable[[], T], version: Hashable = None) -> T:
    """make(), kept in `slot` while `target` lives and made again when `version` changes (a
    drafter's files written again: the old one is dropped). Drafters built per request (the
    server's, each generate call's) share what it makes, a view of the target or a trained
    drafter's network, and so the weights prepared on it at first use (per_model): the built-in
    model's early-exit drafter took 0.5 s a build when each made its own view."""
    made = _PER_TARGET.setdefault(target, {})
    if slot not in made or made[slot][0] != version:
        made[slot] = (version, make())
    return made[slot][1]
