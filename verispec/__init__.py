"""verispec: lossless speculative decoding for Hugging Face causal LMs."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# Each public name and the module that defines it, imported on first use: most of them import
# torch and transformers (seconds), which `verispec --help` and a light submodule need not wait for.
_EXPORTS = {
    "generate": "verispec.api", "stream": "verispec.api",
    "load": "verispec.model.loading", "load_model": "verispec.model.loading",
    "LoadedModel": "verispec.model.loading", "build_engine": "verispec.methods",
    "METHODS": "verispec.methods", "DraftOptions": "verispec.options",
    "SpeculativeEngine": "verispec.decoding.engine", "SamplingParams": "verispec.core.types",
    "GenerationResult": "verispec.core.types", "Fate": "verispec.core.types",
    "VerispecError": "verispec.core.errors",
}
__all__ = ["generate", "stream", "load", "load_model", "LoadedModel", "build_engine", "METHODS",
           "DraftOptions", "SpeculativeEngine", "SamplingParams", "GenerationResult", "Fate",
           "VerispecError"]  # _EXPORTS' names


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'verispec' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value  # the next access is a plain attribute
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])


if TYPE_CHECKING:
    from verispec.api import generate, stream
    from verispec.core.errors import VerispecError
    from verispec.core.types import Fate, GenerationResult, SamplingParams
    from verispec.decoding.engine import SpeculativeEngine
    from verispec.methods import METHODS, build_engine
    from verispec.model.loading import LoadedModel, load, load_model
    from verispec.options import DraftOptions
