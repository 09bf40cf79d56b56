"""Self-speculation in low precision: the target's own weights, stored in int4, int8 or bfloat16,
draft for the float target (QSpec 2024, ML-SpecQD 2025). No training, any model the lean path
runs (verispec.model.lean.FAMILIES: Llama, Mistral, Qwen2/2.5, Qwen3, Gemma 3, on CPU).

The drafter is a second lean decoder (verispec.model.lean) over a low-precision copy of every linear
weight, the LM head included; it shares the target's embedding, norms and rotary tables (small,
read-only) and keeps its own KV cache. It may skip decoder layers (Draft & Verify). For a GGUF
target stored in Q4_0 / Q4_1, the int4 copy is the file's own blocks, checked at load against
the weights the target runs. It drafts like any draft model (ModelDrafter): chains, top-k trees,
exact sampling with its warped q, confidence threshold, and staged drafting behind prompt lookup.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
from torch import nn

from verispec.core.errors import VerispecError
from verispec.core.tree import TreeSettings
from verispec.drafters.model import ModelDrafter
from verispec.drafters.ngram import PromptLookupDrafter
from verispec.model.cached_model import CachedModel
from verispec.model.gguf_blocks import own_int4
from verispec.model.lean import (
    FAMILIES,
    LeanDecoder,
    LeanWeights,
    Product,
    fused_rms_norm,
    lean_supported,
    with_bias,
)
from verispec.model.loading import LoadedModel
from verispec.model.lowbit import (
    FORMATS,
    INT4_GROUPS,
    RescoredHead,
    candidates,
    choose_kernel,
    fuse,
    gguf_int4,
    quantize,
)
from verispec.model.packed import per_model


@dataclass(frozen=True)
class SelfSettings:
    """How the target's weights are stored for drafting."""

    fmt: str = "int4"  # one of lowbit.FORMATS
    group: int = 32  # int4: input columns sharing a scale and minimum
    skip: tuple[int, ...] = ()  # decoder layers the drafter leaves out
    # The LM head's format: one of lowbit.FORMATS, or "target" to share the target's own head
    # (no extra memory, its full precision, the cost of reading it); None: as `fmt`.
    head: str | None = None
    # The head's `rescore` highest low-precision logits are recomputed with the target's own head
    # weights (lowbit.RescoredHead): int4 head top-1 agreement 0.89 -> 0.99 on SmolLM2. 0: off.
    rescore: int = 8


class SelfWeights:
    """The low-precision lean weights of one target, and which kernels they run on."""

    def __init__(self, target: LoadedModel, settings: SelfSettings) -> None:
        model = target.model
        check(target, settings)
        self.settings = settings
        blocks = gguf_int4(target.gguf, model.config) if _takes_gguf(target, settings) else {}
        names = {id(module): name for name, module in model.named_modules()}
        params = {name: module.weight for name, module in model.named_modules()
                  if isinstance(module, nn.Linear)}
        # GGUF blocks are used only where they are exactly the weights the target runs.
        self.from_gguf = {name for name, weight in blocks.items()
                          if torch.equal(weight.dequantize().to(params[name.removesuffix(".weight")].dtype),
                                         params[name.removesuffix(".weight")].detach())}
        config = model.config.get_text_config(decoder=True)
        hidden, inner = int(config.hidden_size), int(config.intermediate_size)
        attention = model.model.layers[0].self_attn
        qkv = (attention.q_proj.out_features + 2 * attention.k_proj.out_features, hidden)
        layer_shapes = (qkv, (hidden, attention.o_proj.in_features), (2 * inner, hidden), (hidden, inner))
        head = model.get_output_embeddings()
        formats = {"layers": settings.fmt, "head": settings.head or settings.fmt}
        shapes = {"layers": layer_shapes, "head": ((head.out_features, head.in_features),)}
        build = {part: candidates(fmt, model.device)[choose_kernel(fmt, shapes[part], settings.group)]
                 for part, fmt in formats.items() if fmt != "target"}
        self.nbytes = 0  # bytes of the stored weights
        self.names: dict[str, str] = {}  # part -> the kernel it runs on

        def linear(modules: list[nn.Linear]) -> Product:
            part = "head" if modules[0] is head else "layers"
            if formats[part] == "target":
                self.names[part] = "the target's own (shared)"
                return LeanWeights.of(model).head
            stored = []
            for module in modules:
                name = f"{names[id(module)]}.weight"
                own = own_int4(module) if formats[part] == "int4" else None
                if own is not None and own.group == settings.group:
                    # a 4-bit target's own codes, or a GGUF target's 4-bit blocks
                    stored.append(own)
                else:
                    stored.append(blocks[name] if name in self.from_gguf
                                  else quantize(module.weight, formats[part], settings.group))
            kernel = build[part](fuse(stored))
            if part == "head" and settings.rescore:
                kernel = RescoredHead(kernel, head.weight, settings.rescore)
            self.nbytes += kernel.nbytes
            self.names[part] = kernel.name
            return with_bias(kernel, modules)

        self.kept = [i for i in range(len(model.model.layers)) if i not in settings.skip]
        self.lean = LeanWeights(model, linear, self.kept, fused_rms_norm)

    def describe(self) -> str:
        """What the drafter runs, for reports: format, kernels, layers, where the weights came from."""
        layers = len(self.lean.layers)
        skipped = f", layers {sorted(self.settings.skip)} skipped" if self.settings.skip else ""
        source = f", {len(self.from_gguf)} weights from the GGUF file's blocks" if self.from_gguf else ""
        return (f"{self.settings.fmt}: layers {self.names['layers']}, head {self.names['head']}; "
                f"{layers} layers{skipped}{source}; {self.nbytes / 2**20:.0f} MiB")


def _takes_gguf(target: LoadedModel, settings: SelfSettings) -> bool:
    """Whether to read the file's blocks (a 4-bit target holds them already)."""
    return settings.fmt == "int4" and settings.group == 32 and target.gguf is not None and not target.kernel


def check(target: LoadedModel, settings: SelfSettings) -> None:
    """Raise a clear error unless `target` can draft for itself with these settings."""
    model = target.model
    if settings.fmt not in FORMATS:
        raise VerispecError(f"unknown weight format {settings.fmt!r}; choose from {', '.join(FORMATS)}")
    if isinstance(settings.rescore, bool) or not isinstance(settings.rescore, int) or settings.rescore < 0:
        raise VerispecError(f"rescore must be an integer >= 0, got {settings.rescore!r}")
    if settings.head is not None and settings.head not in (*FORMATS, "target"):
        raise VerispecError(f"unknown LM head format {settings.head!r}; choose from "
                            f"{', '.join(FORMATS)} or 'target'")
    if settings.fmt == "int4" and settings.group not in INT4_GROUPS:
        raise VerispecError(f"int4 group size must be one of {INT4_GROUPS}, got {settings.group}")
    if model.device.type != "cpu":
        raise VerispecError(f"self-speculation runs on CPU (torch's low-precision CPU kernels); "
                            f"the target is on {model.device.type}")
    if not lean_supported(model):
        families = ", ".join(family.name for family in FAMILIES)
        raise VerispecError(f"self-speculation needs a decoder of a lean family ({families}) in "
                            f"float32 or bfloat16 on CPU; {type(model).__name__} is not one")
    layers = len(model.model.layers)
    bad = [i for i in settings.skip if not 0 <= i < layers]
    if bad or len(set(settings.skip)) >= layers:
        raise VerispecError(f"layers to skip must be distinct indices in 0..{layers - 1}, leaving "
                            f"at least one; got {list(settings.skip)}")
    if settings.fmt == "int4":
        linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
        widths = {m.in_features for m in linears}
        if any(w % settings.group for w in widths):
            raise VerispecError(f"int4 groups of {settings.group} need every linear layer's input "
                                f"width to be a multiple of it; this model has {sorted(widths)}")
        if any(m.out_features % 16 for m in linears):  # torch's int4 packing works in 16 rows
            raise VerispecError("int4 weights need every linear layer's output width to be a "
                                "multiple of 16; use self-int8 or self-bf16 for this model")


# settings -> {target model -> (fingerprint, SelfWeights)}: engines built per call share the copy.
_WEIGHTS: dict[SelfSettings, weakref.WeakKeyDictionary] = {}


def self_weights(target: LoadedModel, settings: SelfSettings) -> SelfWeights:
    """The (cached) low-precision weights of `target`; renewed when a linear weight changed."""
    cache = _WEIGHTS.setdefault(settings, weakref.WeakKeyDictionary())
    return per_model(cache, target.model, lambda _: SelfWeights(target, settings))


def forget_weights(model: nn.Module, keep: SelfSettings | None = None) -> None:
    """Drop the cached low-precision copies of `model` but `keep`'s (a drafter holding one keeps
    it): `auto` profiles every format once and drafts with one."""
    for settings, cache in _WEIGHTS.items():
        if settings != keep:
            cache.pop(model, None)


class SelfDrafter(ModelDrafter):
    """A ModelDrafter over `target`'s own weights in low precision (behind `lookup` if given).

    It starts each sequence from a copy of the target's own keys and values for the prompt
    instead of prefilling it in low precision (the integer kernels are slow on many rows:
    docs/self-speculation.md has the costs). Drafting after a float prompt cache only agrees
    better with the target.
    """

    adopts_prefill = True

    def __init__(self, target: LoadedModel, settings: SelfSettings,
                 confidence_threshold: float | None = None, tree: TreeSettings | None = None,
                 lookup: PromptLookupDrafter | None = None) -> None:
        self.weights = self_weights(target, settings)
        # A drafter need not be batch-invariant (the target's verification keeps the output exact).
        lm = CachedModel(target.model, lean=LeanDecoder(self.weights.lean, target.model.device,
                                                        invariant=False))
        super().__init__(lm, target.vocab_size, confidence_threshold, tree, lookup)

    def adopt_prefill(self, target: CachedModel) -> None:
        """Copy the target's cached keys and values (the prompt) into this drafter's cache."""
        if target.lean is None:
            return  # the target runs through its own forward: the drafter prefills itself
        for mine, index in zip(self.lm.lean.caches, self.weights.kept):
            theirs = target.lean.caches[index]
            mine.rewind(0)
            mine.append(theirs.keys[:, :, : theirs.length], theirs.values[:, :, : theirs.length])

    @property
    def nbytes(self) -> int:
        """Bytes of this drafter's own weights."""
        return self.weights.nbytes

    def describe(self) -> str:
        return self.weights.describe() + (", staged behind prompt lookup" if self.lookup else "")
