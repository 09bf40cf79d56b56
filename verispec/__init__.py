"""verispec: lossless speculative decoding for Hugging Face causal LMs."""

from verispec.api import generate, stream
from verispec.core.errors import VerispecError
from verispec.core.types import Fate, GenerationResult, SamplingParams
from verispec.decoding.engine import SpeculativeEngine
from verispec.methods import METHODS, build_engine
from verispec.model.loading import LoadedModel, load, load_model
from verispec.options import DraftOptions

__all__ = ["generate", "stream", "load", "load_model", "LoadedModel", "build_engine",
           "DraftOptions", "METHODS", "SpeculativeEngine", "SamplingParams", "GenerationResult",
           "Fate", "VerispecError"]
