"""verispec: lossless speculative decoding for Hugging Face causal LMs."""

from verispec.api import generate, stream
from verispec.engine import SpeculativeEngine
from verispec.errors import VerispecError
from verispec.methods import METHODS, build_engine
from verispec.models import LoadedModel, load, load_model
from verispec.options import DraftOptions
from verispec.types import Fate, GenerationResult, SamplingParams

__all__ = ["generate", "stream", "load", "load_model", "LoadedModel", "build_engine",
           "DraftOptions", "METHODS", "SpeculativeEngine", "SamplingParams", "GenerationResult",
           "Fate", "VerispecError"]
