"""Speculation methods by name: the one place that maps a method to its drafter.

Adding a drafter is one new file plus one entry in METHODS; the engine never changes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from verispec.drafters.base import Drafter, DraftRequest
from verispec.drafters.distilled import distilled_drafter
from verispec.drafters.eagle import EagleDrafter
from verispec.drafters.eagle3 import Eagle3Drafter
from verispec.drafters.early_exit import default_exit_layer, early_exit_drafter
from verispec.drafters.hybrid import LookupThenModel
from verispec.drafters.hydra import HydraDrafter
from verispec.drafters.learned import drafter_config, is_drafter_dir, shipped_drafter
from verispec.drafters.lookahead import LookaheadDrafter
from verispec.drafters.medusa import MedusaDrafter
from verispec.drafters.model import ModelDrafter, check_same_vocabulary
from verispec.drafters.mtp import MTPDrafter
from verispec.drafters.ngram import PromptLookupDrafter
from verispec.drafters.self_spec import SelfDrafter, SelfSettings
from verispec.drafters.self_spec import check as check_self
from verispec.drafters.trained_exit import trained_exit_drafter
from verispec.engine import Speculation, SpeculativeEngine
from verispec.errors import VerispecError
from verispec.lowbit import FORMATS
from verispec.models import LoadedModel, load
from verispec.policies import SCHEDULES
from verispec.tree import TreeSettings
from verispec.types import SamplingParams
from verispec.verifiers import verifier_for


@dataclass(frozen=True)
class DraftOptions:
    """Every method setting, with its default; unset k means the method's own default."""

    k: int | None = None
    schedule: str = "constant"  # or "heuristic": +2 after a full accept, -1 otherwise
    confidence_threshold: float | None = None  # model drafters stop below this confidence
    # draft model: name, directory, GGUF or loaded model; for eagle / medusa / early-exit, a
    # trained drafter directory (default: the one shipped for the target, if any)
    draft: str | LoadedModel | None = None
    exit_layer: int | None = None  # early exit: layers kept (default: the trained exit's, or half)
    max_ngram: int = 4  # prompt lookup: longest n-gram matched (tried first: the surest drafts)
    min_ngram: int = 2  # prompt lookup: shortest n-gram matched (1 drafts too often to pay on CPU)
    # Draft a token tree of depth k instead of a chain (methods in TREE_METHODS); None: a chain;
    # DEFAULT_TREE: the method's own default tree (Method.default_tree).
    tree: TreeSettings | str | None = None
    # "exact" (lossless) or "typical" (Medusa's typical acceptance: LOSSY under sampling)
    acceptance: str = "exact"
    group: int = SelfSettings.group  # self-int4: input columns sharing a scale (32, 64 or 128)
    skip_layers: tuple[int, ...] = SelfSettings.skip  # self-*: decoder layers the drafter leaves out
    lookahead_window: int = 2  # lookahead: W, the Jacobi window's guesses per iteration
    lookahead_ngram: int | None = None  # lookahead: N, the n-gram size (None: k + 1)
    lookahead_guesses: int = 2  # lookahead: G, pooled n-grams kept (and verified) per first token
    lookahead_pool_context: bool = True  # lookahead: pool the prompt's and output's n-grams too


def _draft_model(target: LoadedModel, options: DraftOptions) -> Drafter:
    """A distilled student (given as --draft DIR, or shipped for the target), else any causal LM."""
    draft = options.draft
    if draft is None or (not isinstance(draft, LoadedModel) and is_drafter_dir(draft)):
        trained = _trained(target, options, "draft")
        if trained is None:
            raise VerispecError("method 'draft' needs a draft model (--draft PATH / assistant_model=)")
        return distilled_drafter(trained, target.model, target.vocab_size,
                                 options.confidence_threshold, options.tree)
    if not isinstance(draft, LoadedModel):
        draft = load(draft, dtype=_dtype_name(target), device=str(target.model.device))
    if draft.tokenizer is None and target.tokenizer is not None:
        raise VerispecError(f"draft model {draft.name} has no tokenizer to check against the target's")
    check_same_vocabulary(target.tokenizer, draft.tokenizer)
    return ModelDrafter(draft.model, target.vocab_size, options.confidence_threshold, options.tree)


def _trained(target: LoadedModel, options: DraftOptions, kind: str) -> Path | None:
    """The trained drafter directory to use: --draft if given, else the one shipped for target."""
    if options.draft is None:
        return shipped_drafter(target.model, kind)
    if isinstance(options.draft, LoadedModel) or not is_drafter_dir(options.draft):
        raise VerispecError(f"method {kind!r} takes a trained drafter directory as --draft "
                            f"(made by `verispec train {kind}`), got {options.draft}")
    return Path(options.draft)


def _learned(kind: str, load_drafter: Callable[[Path, LoadedModel, DraftOptions], Drafter]
             ) -> Callable[[LoadedModel, DraftOptions], Drafter]:
    """A builder for a method that only exists as a trained drafter of `kind`."""
    def build(target: LoadedModel, options: DraftOptions) -> Drafter:
        path = _trained(target, options, kind)
        if path is None:
            raise VerispecError(
                f"no trained {kind} drafter ships for {target.name}: train one with "
                f"`verispec train {kind} --target {target.name} --out DIR` and pass --draft DIR")
        return load_drafter(path, target, options)
    return build


def _early_exit(target: LoadedModel, options: DraftOptions) -> Drafter:
    """The trained exit when one is given or shipped (and the layer agrees), else the plain one."""
    trained = _trained(target, options, "early-exit")
    if trained is not None:
        layer = drafter_config(trained)["settings"]["exit_layer"]
        if options.exit_layer is None or options.exit_layer == layer:
            return trained_exit_drafter(trained, target.model, target.vocab_size,
                                        options.confidence_threshold, options.tree)
        if options.draft is not None:
            raise VerispecError(f"the trained exit in {trained} is at layer {layer}, "
                                f"not {options.exit_layer}")
    layers = default_exit_layer(target.model) if options.exit_layer is None else options.exit_layer
    return early_exit_drafter(target.model, layers, target.vocab_size, options.confidence_threshold,
                              options.tree)


def _prompt_lookup(target: LoadedModel, options: DraftOptions) -> Drafter:
    return PromptLookupDrafter(options.max_ngram, options.min_ngram, options.tree)


def _lookahead(target: LoadedModel, options: DraftOptions) -> Drafter:
    """N defaults to k + 1: the draft length is the n-gram's tail."""
    k = METHODS["lookahead"].default_k if options.k is None else options.k
    ngram = k + 1 if options.lookahead_ngram is None else options.lookahead_ngram
    return LookaheadDrafter(options.lookahead_window, ngram, options.lookahead_guesses,
                            options.lookahead_pool_context)


def _lookup_then(method: str) -> Callable[[LoadedModel, DraftOptions], Drafter]:
    """A builder for prompt lookup backed by `method`'s drafter (drafting up to its default k)."""
    def build(target: LoadedModel, options: DraftOptions) -> Drafter:
        spec = METHODS[method]
        return LookupThenModel(_prompt_lookup(target, options), spec.build(target, options),
                               spec.default_k)
    return build


def _self(fmt: str, staged: bool) -> Callable[[LoadedModel, DraftOptions], Drafter]:
    """A builder for the target's own weights in `fmt` drafting (behind prompt lookup if staged)."""
    def build(target: LoadedModel, options: DraftOptions) -> Drafter:
        settings = SelfSettings(fmt, options.group, tuple(options.skip_layers))
        return SelfDrafter(target, settings, options.confidence_threshold, options.tree,
                           _prompt_lookup(target, options) if staged else None)
    return build


def _dtype_name(target: LoadedModel) -> str:
    return str(target.model.dtype).removeprefix("torch.")


DEFAULT_TREE = "default"


@dataclass(frozen=True)
class Method:
    name: str
    description: str
    default_k: int
    build: Callable[[LoadedModel, DraftOptions], Drafter] | None  # None: plain decoding
    trained_kind: str | None = None  # the trained drafter (`verispec train KIND`) it runs, if any
    # The tree `--tree` alone drafts (depth default_k): the fastest measured on held-out prompts
    # on a CPU (scripts/tune_trees.py); None: not swept (slower than plain decoding here).
    default_tree: TreeSettings | None = None


METHODS: dict[str, Method] = {m.name: m for m in [
    Method("ar", "plain autoregressive decoding (no speculation)", 0, None),
    Method("draft", "independent draft model with the target's tokenizer (SpS), or a student "
           "distilled by verispec train draft", 5, _draft_model, "draft"),
    # k = 7: first set from Spec-Bench dev runs (k = 7 beat 3, 8 and 15, with 4-row padding);
    # confirmed on held-out training-family prompts with the lean forward (lookup k 7 and 5 tie
    # inside eagle-pld, 3 is worse: scripts/tune_draft_lengths.py).
    # Default trees (all methods): scripts/tune_trees.py on held-out prompts, seeds 779 (8
    # prompts) and 780 (10), lean CPU forward, speedup over ar, chain -> tree. pld: 1.33 -> 1.39
    # (4x16), 1.32 -> 1.34 (4x16) / 1.37 (4x24). eagle: 1.14 -> 1.17 (2x3; 2x4, 4x7 and deeper
    # trees slower), 1.27 -> 1.25. medusa: 0.96 -> 0.95 (2x4; larger slower). eagle-pld: 1.47 ->
    # 1.48 (2x3) / 1.49 (4x7), 1.45 -> 1.45 (2x3) / 1.40 (4x7). Chains stay the methods'
    # defaults: on a 2-core CPU no tree beat them by more than the runs' noise.
    Method("pld", "prompt lookup: n-gram matches in the prompt and output", 7, _prompt_lookup,
           default_tree=TreeSettings(4, 16)),
    Method("early-exit", "the target's first layers draft, through a trained exit when one "
           "exists (LayerSkip-style)", 5, _early_exit, "early-exit"),
    # k = 2: on held-out training-family prompts (scripts/tune_draft_lengths.py, seeds 777 and
    # 778), k = 2 beat 1 and 3 for eagle and inside eagle-pld, with the lean CPU forward.
    Method("eagle", "EAGLE-style feature drafter: one layer predicts the target's next hidden "
           "state", 2, _learned("eagle", lambda path, target, options: EagleDrafter.load(
               path, target.model, options.confidence_threshold, options.tree)), "eagle",
           TreeSettings(2, 3)),
    Method("medusa", "Medusa-1 heads on the target's last hidden state", 3, _learned(
        "medusa", lambda path, target, options: MedusaDrafter.load(path, target.model, options.tree)),
        "medusa", TreeSettings(2, 4)),
    # k is the lookup's (7, as pld); the EAGLE drafter drafts up to its own default (2).
    Method("eagle-pld", "prompt lookup where the context repeats, the EAGLE drafter elsewhere "
           "(SAMD-style hybrid)", 7, _lookup_then("eagle"), "eagle", TreeSettings(2, 3)),
    # The structure vLLM and SGLang run (verispec export writes it for them). No default tree:
    # none was swept for it.
    Method("eagle3", "EAGLE-3 drafter: three of the target's layers fused, its own reduced-vocabulary "
           "head (exportable to vLLM / SGLang)", 2, _learned("eagle3", lambda path, target, options:
               Eagle3Drafter.load(path, target.model, options.confidence_threshold, options.tree)),
           "eagle3"),
    # k = 4: every head the shipped drafters have. No default trees: none was swept.
    Method("hydra", "Hydra heads: Medusa-style heads that also read the tokens drafted before "
           "them", 4, _learned("hydra", lambda path, target, options: HydraDrafter.load(
               path, target.model, options.tree)), "hydra"),
    Method("mtp", "multi-token prediction heads: one decoder layer per future token on the "
           "target's frozen trunk, the target's norm and LM head shared", 4, _learned(
               "mtp", lambda path, target, options: MTPDrafter.load(path, target.model, options.tree)),
           "mtp"),
    # k: held-out prompts (seeds 791, 792; scripts/held_out.py), lean CPU forward, ms per token:
    # self-int4 k 6 / 8 / 10 / 12 / 14 within 10% of each other (acceptance ~99%: the draft
    # cost, not tau, decides), 8 chosen; staged k 10 best or tied with 14 and 16.
    *(Method(f"self-{fmt}", f"the target's own weights in {fmt} draft (no training; Llama-shaped "
             "models on CPU)", 8, _self(fmt, False)) for fmt in FORMATS),
    *(Method(f"self-{fmt}-pld", f"staged: prompt lookup guesses, the target's own weights in {fmt} "
             "check and extend them, the target verifies", 10, _self(fmt, True)) for fmt in FORMATS),
    # k = N - 1 = 2, W 2, G 2, context pooled (DraftOptions): held-out prompts (scripts/
    # tune_lookahead.py 4 801 96 and 4 802 96; docs/lookahead.md), 96 tokens, lean CPU forward,
    # shared 2-core AMD EPYC, speed vs ar (tau): 2x3x2c 1.15x (1.34) / 0.97x (1.25); 2x3x2 1.16x,
    # 1.11x (1.27) / 0.94x (1.21); pld 1.20x, 1.10x / 1.07x; the paper's 5x4x5 0.90x (1.45) and
    # 7x4x7 0.80x (1.52): on 2 cores every extra row costs, so the smallest window wins.
    Method("lookahead", "lookahead decoding: Jacobi iteration in the same target forward fills an "
           "n-gram pool whose n-grams after the last token are verified (no training)", 2, _lookahead),
]}


TREE_METHODS = ("eagle", "medusa", "pld", "draft", "early-exit", "eagle-pld", "eagle3", "hydra", "mtp",
                *(f"self-{fmt}" for fmt in FORMATS))


def parse_tree(text: str) -> TreeSettings | str:
    """'4x16' -> TreeSettings(topk=4, nodes=16); DEFAULT_TREE stays: the method's default tree."""
    if text.lower() == DEFAULT_TREE:
        return DEFAULT_TREE
    try:
        topk, nodes = (int(part) for part in text.lower().split("x"))
        return TreeSettings(topk, nodes)
    except (ValueError, VerispecError):
        raise VerispecError(f"expected a tree as TOPKxNODES with both >= 1, e.g. 4x16, or "
                            f"{DEFAULT_TREE!r}; got {text!r}") from None


def resolve_tree(method: str, tree: TreeSettings | str | None) -> TreeSettings | None:
    """The tree settings `tree` stands for (DEFAULT_TREE: the method's default tree), after
    checking that `method` drafts trees at all."""
    if tree is None:
        return None
    if method not in TREE_METHODS:
        raise VerispecError(f"method {method!r} drafts chains only; trees: {', '.join(TREE_METHODS)}")
    if isinstance(tree, TreeSettings):
        return tree
    if tree != DEFAULT_TREE:
        raise VerispecError(f"a tree is TreeSettings(topk, nodes) or {DEFAULT_TREE!r}, got {tree!r}")
    default = METHODS[method].default_tree
    if default is None:
        measured = ", ".join(m for m in TREE_METHODS if METHODS[m].default_tree is not None)
        raise VerispecError(f"method {method!r} has no measured default tree (those with one: "
                            f"{measured}); give its size as TOPKxNODES")
    return default


# The fastest combination measured on the built-in model (README "Results"), and what models that
# cannot run it (off the lean CPU path) get instead.
FASTEST = "self-int4-pld"
FALLBACK = "pld"


def fastest_method(target: LoadedModel) -> str:
    """The default method for `target`: FASTEST where it can run it, else FALLBACK."""
    try:
        check_self(target, SelfSettings())
    except VerispecError:
        return FALLBACK
    return FASTEST


def build_speculation(target: LoadedModel, method: str = "ar",
                      options: DraftOptions = DraftOptions()) -> Speculation:
    """How sequences speculate with `method` on `target` (a drafter, a way to make more, the
    draft-length policy, the acceptance rule); validates every option."""
    if method not in METHODS:
        raise VerispecError(f"unknown method {method!r}; choose from {', '.join(METHODS)}")
    spec = METHODS[method]
    k = spec.default_k if options.k is None else options.k
    if isinstance(k, bool) or not isinstance(k, int) or k < 0:
        raise VerispecError(f"draft length k must be an integer >= 0 (0: no drafting), got {k!r}")
    if options.schedule not in SCHEDULES:
        raise VerispecError(
            f"unknown draft-length schedule {options.schedule!r}; choose from {', '.join(SCHEDULES)}")
    verifier_for(SamplingParams(), options.acceptance)
    options = replace(options, tree=resolve_tree(method, options.tree))
    if spec.build is None or k == 0:
        return Speculation(acceptance=options.acceptance)
    return Speculation(spec.build(target, options), SCHEDULES[options.schedule](k), options.acceptance,
                       lambda: spec.build(target, options))


def build_engine(target: LoadedModel, method: str = "ar",
                 options: DraftOptions = DraftOptions()) -> SpeculativeEngine:
    """An engine for `target` speculating with `method`; validates every option."""
    how = build_speculation(target, method, options)
    return SpeculativeEngine(target.model, how.drafter, how.policy, how.acceptance, how.spawn)


__all__ = ["DEFAULT_TREE", "FALLBACK", "FASTEST", "Drafter", "DraftRequest", "DraftOptions", "Eagle3Drafter",
           "EagleDrafter", "HydraDrafter", "LookaheadDrafter", "LookupThenModel", "METHODS", "MTPDrafter",
           "MedusaDrafter", "Method", "ModelDrafter", "PromptLookupDrafter", "SelfDrafter", "Speculation",
           "build_engine", "build_speculation", "early_exit_drafter", "fastest_method", "parse_tree",
           "resolve_tree"]
