"""The method registry: one record per speculation method, everything the rest of verispec asks
about it (its drafter, default k, trees, bench default, trained kind, help and README text).

It sits above the engine and the drafters: it builds engines from names. Nothing else lists
method names; adding a method is one drafter file plus one `Method` entry in METHODS.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from enum import Enum
from functools import partial
from pathlib import Path

from verispec.core.errors import VerispecError
from verispec.core.policies import SCHEDULES
from verispec.core.tree import TreeSettings
from verispec.core.types import SamplingParams
from verispec.decoding.engine import SpeculativeEngine
from verispec.decoding.sequence import Speculation
from verispec.drafters.auto import MODEL_PRIOR, TREE_LEVEL, AutoDrafter, CostProfile, best_choice
from verispec.drafters.base import Drafter
from verispec.drafters.block import BlockDrafter
from verispec.drafters.cross import CrossDrafter
from verispec.drafters.distilled import DraftStudent, distilled_drafter
from verispec.drafters.eagle import EagleDrafter
from verispec.drafters.eagle3 import Eagle3Drafter
from verispec.drafters.early_exit import default_exit_layer, early_exit_drafter
from verispec.drafters.hybrid import LookupThenModel
from verispec.drafters.hydra import HydraDrafter
from verispec.drafters.learned import drafter_config, is_drafter_dir, shipped_drafter
from verispec.drafters.lookahead import LookaheadDrafter
from verispec.drafters.medusa import MedusaDrafter
from verispec.drafters.model import ModelDrafter, same_vocabulary
from verispec.drafters.mtp import MTPDrafter
from verispec.drafters.ngram import PromptLookupDrafter
from verispec.drafters.self_spec import SelfDrafter, SelfSettings, forget_weights
from verispec.drafters.self_spec import check as check_self
from verispec.drafters.suffix import SuffixDrafter, SuffixSettings, shared_cache
from verispec.drafters.trained_exit import ExitAdapter, trained_exit_drafter
from verispec.drafters.vocab import bridge
from verispec.model.loading import LoadedModel, load
from verispec.model.lowbit import FORMATS, weight_format
from verispec.options import DEFAULT_TREE, DraftOptions
from verispec.profile import cost_profile
from verispec.verifiers import verifier_for


def _draft_model(target: LoadedModel, options: DraftOptions) -> Drafter:
    """A distilled student (given as --draft DIR, or shipped for the target), else any causal LM."""
    draft = options.draft
    if draft is None or (not isinstance(draft, LoadedModel) and is_drafter_dir(draft)):
        trained = _trained(target, options, DraftStudent.kind)
        if trained is None:
            raise VerispecError("method 'draft' needs a draft model (--draft PATH / assistant_model=)")
        return distilled_drafter(trained, target.model, target.vocab_size,
                                 options.confidence_threshold, options.tree)
    if not isinstance(draft, LoadedModel):
        draft = load(draft, dtype=_dtype_name(target), device=str(target.model.device))
    if draft.tokenizer is None and target.tokenizer is not None:
        raise VerispecError(f"draft model {draft.name} has no tokenizer to check against the target's")
    if same_vocabulary(target.tokenizer, draft.tokenizer):
        return ModelDrafter(draft.model, target.vocab_size, options.confidence_threshold, options.tree)
    if options.tree is not None:
        raise VerispecError(f"draft model {draft.name} has another tokenizer than the target's: it "
                            "drafts chains only (no --tree)", field="tree")
    crossing = bridge(target.tokenizer, draft.tokenizer, target.vocab_size, draft.vocab_size,
                      target.eos_token_ids, draft.eos_token_ids)
    return CrossDrafter(draft.model, crossing, target.vocab_size, options.confidence_threshold)


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
    trained = _trained(target, options, ExitAdapter.kind)
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


def _suffix(target: LoadedModel, options: DraftOptions, owner: str = "suffix") -> Drafter:
    """Suffix decoding over the request and, where cache_tokens > 0, the model's earlier outputs
    (those of `owner`'s drafters: each method keeps its own)."""
    settings = SuffixSettings(factor=options.suffix_factor, min_prob=options.suffix_min_prob,
                              cache_tokens=options.suffix_cache_tokens)
    cache = shared_cache(target.model, settings.cache_tokens, owner) if settings.cache_tokens else None
    return SuffixDrafter(settings, cache, options.tree)


def _lookahead(target: LoadedModel, options: DraftOptions) -> Drafter:
    """N defaults to k + 1: the draft length is the n-gram's tail."""
    k = METHODS["lookahead"].default_k if options.k is None else options.k
    ngram = k + 1 if options.lookahead_ngram is None else options.lookahead_ngram
    return LookaheadDrafter(options.lookahead_window, ngram, options.lookahead_guesses,
                            options.lookahead_pool_context)


def _lookup_then(method: str, lookup: Callable[[LoadedModel, DraftOptions], Drafter]
                 ) -> Callable[[LoadedModel, DraftOptions], Drafter]:
    """A builder for `lookup`'s drafter backed by `method`'s (drafting up to options.model_k
    tokens where the lookup has none, default its k)."""
    def build(target: LoadedModel, options: DraftOptions) -> Drafter:
        spec = METHODS[method]
        depth = spec.default_k if options.model_k is None else options.model_k
        return LookupThenModel(lookup(target, options), spec.build(target, options), depth)
    return build


def _self(fmt: str, staged: bool) -> Callable[[LoadedModel, DraftOptions], Drafter]:
    """A builder for the target's own weights in `fmt` drafting (behind prompt lookup if staged)."""
    def build(target: LoadedModel, options: DraftOptions) -> Drafter:
        settings = SelfSettings(fmt, options.group, tuple(options.skip_layers))
        return SelfDrafter(target, settings, options.confidence_threshold, options.tree,
                           _prompt_lookup(target, options) if staged else None)
    return build


# What `auto` chooses among: lookups, the target's own weights, and a trained drafter where one
# ships for the target. Prompt lookup is no candidate: behind suffix decoding it never drafted a
# token on the held-out prompts of all seven targets measured (docs/tuning.md), and asking it cost
# ~0.05 ms every step.
AUTO_LOOKUPS = ("suffix",)  # in order of preference (verispec.drafters.auto)
AUTO_SELF = tuple(f"self-{fmt}" for fmt in FORMATS)
# EAGLE: the trained drafter that paid best behind suffix decoding on the 4-bit target (eagle-suffix,
# docs/tuning.md); only the shipped one (a drafter given with --draft is the user's method, not auto's).
AUTO_TRAINED = ("eagle",)


def _auto_candidates(target: LoadedModel, options: DraftOptions
                     ) -> tuple[dict[str, Callable[[], Drafter]], dict[str, int]]:
    """`auto`'s candidates on `target` (name -> a builder of its drafter, drafting chains) and
    the most each may draft: the lookups, each self format the target can draft in, and the
    trained drafters shipped for it."""
    chains = replace(options, tree=None)
    names = list(AUTO_LOOKUPS)
    # A copy in the target's own format drafts at a target forward a token: never a candidate.
    own = {"int4": "self-int4", "gguf": "self-int4", "bfloat16": "self-bf16"}.get(weight_format(target.model))
    for name in (name for name in AUTO_SELF if name != own):
        try:
            check_self(target, SelfSettings(name.removeprefix("self-"), options.group,
                                            tuple(options.skip_layers)))
            names.append(name)
        except VerispecError:
            pass
    if options.draft is None:
        names += [name for name in AUTO_TRAINED
                  if shipped_drafter(target.model, METHODS[name].trained_kind) is not None]
    limits = {name: _limit(name, options) for name in names}
    builders = {name: partial(METHODS[name].build, target, chains) for name in names}
    builders["suffix"] = partial(_suffix, target, chains, "auto")  # auto's answers feed only auto's
    return builders, limits


def auto_profile(target: LoadedModel, options: DraftOptions = DraftOptions(),
                 refresh: bool = False) -> CostProfile:
    """The cost profile `auto` decides by on `target` (verispec.profile.cost_profile: cached,
    measured where it is not, or again with `refresh`)."""
    builders, limits = _auto_candidates(target, options)
    return cost_profile(target, builders, limits, refresh)


def _auto(target: LoadedModel, options: DraftOptions) -> Drafter:
    """The profile's choice every step among the lookups, the target's own weights in the format
    the profile finds fastest (where the target can draft for itself), staged behind prompt
    lookup, the trained drafters shipped for the target, and plain decoding."""
    builders, limits = _auto_candidates(target, options)
    profile = cost_profile(target, builders, limits)
    selves = [name for name in builders if name in AUTO_SELF]
    models = {}
    if selves:
        fastest = _self_format(profile, selves, limits)
        # Staged (self-FMT-pld): where prompt lookup guesses right, one pass of the drafter checks
        # the guesses instead of a pass a token. Priced as the drafter alone, an upper bound that
        # the drafting time auto observes brings down (AutoDrafter's slowdown). Held out, float32:
        # 1.06x auto unstaged (docs/tuning.md, "auto's self-drafter staged").
        staged = f"{fastest}-pld"
        models = {staged: METHODS[staged].build(target, replace(options, tree=None))}
        limits[staged] = _limit(staged, options)
        profile = replace(profile, drafters={**profile.drafters, staged: profile.drafters[fastest]})
        # the other formats' copies were made for timing only
        forget_weights(target.model, SelfSettings(fastest.removeprefix("self-"), options.group,
                                                  tuple(options.skip_layers)))
    trees = {}
    for name in (name for name in AUTO_TRAINED if name in builders):
        # The shape its measured shapes make fastest here (`shaped`): a chain drafts up to its
        # depth, deeper than the method's default k where the shape is (within --k), and no
        # deeper (auto's running acceptance, up after a few kept drafts, chose 2 tokens where 1
        # pays on the 4-bit target: held out, 0.96x against 0.98x eagle-suffix's speed with the
        # depth so bounded); a tree, where verifying its nodes costs little, is drafted whole.
        best = _fastest_shape(profile, name, name)
        if best is not None:
            depth = METHODS[name].default_k if best.k is None else best.k
            limits[name] = depth if options.k is None else min(depth, options.k)
        if best is None or best.tree is None:
            models[name] = builders[name]()
        else:
            models[name] = METHODS[name].build(target, replace(options, tree=best.tree))
            trees[name] = best.tree.nodes
    return AutoDrafter(profile, {name: builders[name]() for name in AUTO_LOOKUPS}, models, limits,
                       PLAIN, trees)


def _limit(name: str, options: DraftOptions) -> int:
    """The most `auto` lets method `name` draft: its default k, within --k."""
    k = METHODS[name].default_k
    return k if options.k is None else min(k, options.k)


def _prior(profile: CostProfile, name: str) -> float:
    measured = profile.drafters[name].acceptance
    return MODEL_PRIOR if measured is None else measured


def _self_format(profile: CostProfile, selves: list[str], limits: dict[str, int]) -> str:
    """The self format auto drafts with: the one with the most expected tokens per second alone,
    by its acceptance pooled over the profile's answers. The choice is made once and never
    revisited, so not by the best answer's (each candidate's optimistic prior): on the off-grid
    copy of the built-in model that was 0.94 for int4 against 0.97 for int8, which chose int4
    where it kept 0.85 of Spec-Bench's drafts against int8's 0.98, and auto ran 0.84x
    self-int8-pld (pooled: 0.85 against 0.97; docs/tuning.md, "auto's self format")."""
    def rate(name: str) -> float:
        pooled = profile.drafters[name].pooled
        acceptance = _prior(profile, name) if pooled is None else pooled
        return best_choice(profile, {name: acceptance}, {name: limits[name]}).tokens_per_second

    return max(selves, key=rate)


def _dtype_name(target: LoadedModel) -> str:
    return str(target.model.dtype).removeprefix("torch.")


@dataclass(frozen=True)
class Shape:
    """A way a trained method drafts (a chain, or a tree of `tree`'s size, of depth `k`, None:
    its drafter's k) and the tokens a step it gained with the drafter shipped for the built-in
    model on held-out prompts: `python scripts/shape_tau.py METHOD` (20 prompts of seed 785, the
    mean over the 4-bit and float32 targets; docs/tuning.md, "Shapes for the drafter shipped")."""

    tree: TreeSettings | None
    tau: float
    k: int | None = None


# The shipped drafter weights (verispec.drafters.learned.weights_digest) each kind's shapes' τ were
# measured with: a re-shipped drafter must measure them again (scripts/shape_tau.py; a test holds it).
SHAPES_MEASURED_WITH = {"eagle": "9a0e38abf4f246b8", "eagle3": "96390fbc9ad29c30"}

# A tree is chosen over the chain only where the model gives it this much more speed: the model
# misses a tree's own verification work (its mask, compacting the cache), which made 2x3 and 2x4
# measure 7-12% below their modelled speed on the 4-bit target.
TREE_MARGIN = 1.05


def _shape_speed(profile: CostProfile, kind: str, shape: Shape) -> float:
    """Tokens a second of `shape` drafted by `kind`'s drafter: its τ over T(1 + nodes) for the
    verify plus the drafter's cost by the profile."""
    depth = METHODS[kind].default_k if shape.k is None else shape.k
    rows = 1 + (depth if shape.tree is None else shape.tree.nodes)
    drafting = profile.drafters[kind].seconds(depth if shape.tree is None else TREE_LEVEL * depth)
    return shape.tau / (profile.forward_seconds(rows) + drafting)


def _fastest_shape(profile: CostProfile, method: str, kind: str) -> Shape | None:
    """`method`'s measured shape (drafted by `kind`'s drafter) with the most modelled speed by
    `profile`; a tree only where it beats the fastest chain by TREE_MARGIN. None: none measured."""
    shapes = METHODS[method].shapes
    if not shapes:
        return None
    speed = partial(_shape_speed, profile, kind)
    chains = [shape for shape in shapes if shape.tree is None]
    best = max(shapes, key=speed)
    if best.tree is not None and chains and speed(best) < TREE_MARGIN * max(map(speed, chains)):
        best = max(chains, key=speed)
    return best


def shaped(target: LoadedModel, method: str, options: DraftOptions) -> DraftOptions:
    """`options` with the tree chosen from this machine's cost profile where the user chose
    neither a tree nor k and the method drafts with its shipped drafter on a CPU: each measured
    shape's τ over its step's modelled seconds, T(1 + nodes) for the verify plus the drafter's
    measured cost (verispec.profile: the forward by rows and the drafter, cached per machine).
    Where verifying extra rows is nearly free (the float32 target here) a 3-token chain (a
    depth-2 tree buys what a chain of as many rows does); where every row costs a fifth of a
    forward (the 4-bit target) a chain of 1-2 (docs/tuning.md, "Shapes for the drafter shipped")."""
    spec = METHODS[method]
    kind = spec.trained_kind
    if (not spec.shapes or options.tree is not None or options.k is not None or options.draft is not None
            or options.model_k is not None or target.model.device.type != "cpu"
            or _trained(target, options, kind) is None):
        return options  # the shapes' τ are the shipped drafter's (none ships for other targets)
    chain = replace(options, tree=None)
    profile = cost_profile(target, {kind: lambda: METHODS[kind].build(target, chain)},
                           {kind: METHODS[kind].default_k})
    best = _fastest_shape(profile, method, kind)
    if best.k is None:
        return replace(options, tree=best.tree)
    # the depth is the method's k where the drafter is the method, else the model's behind a lookup
    return replace(options, tree=best.tree, **{"k" if method == kind else "model_k": best.k})


class Needs(Enum):
    """What a method needs beyond the target."""

    NOTHING = "nothing"
    # the target's own weights, stored again in low precision (verispec.model.lean.FAMILIES)
    SELF = "a Llama, Mistral, Qwen2/2.5, Qwen3 or Gemma 3 model on CPU"
    TRAINED = "a trained drafter"  # of the method's trained_kind, given (--draft) or shipped
    DRAFT_MODEL = "a draft model (`--draft`) or a distilled student"


@dataclass(frozen=True)
class Method:
    """Everything verispec knows about one method. Tuning behind the defaults: docs/tuning.md."""

    name: str
    description: str  # what drafts, one line: help texts and the README's method table
    default_k: int
    build: Callable[[LoadedModel, DraftOptions], Drafter] | None  # None: plain decoding
    use_when: str = ""  # the README table's advice
    needs: Needs = Needs.NOTHING
    trained_kind: str | None = None  # the trained drafter (`verispec train KIND`) it runs, if any
    trees: bool = False  # drafts token trees (--tree)
    # The tree `--tree` alone drafts (depth default_k): the fastest measured on held-out prompts
    # on a CPU (scripts/tune_trees.py); None: none measured.
    default_tree: TreeSettings | None = None
    # Shapes measured with the drafter shipped for the built-in model: without --tree or --k, the
    # one this machine's profile makes fastest (`shaped`); empty: the chain.
    shapes: tuple[Shape, ...] = ()
    bench: bool = True  # in `verispec bench`'s default set, where the model can run it
    hf_peer: str | None = None  # the Hugging Face generate() baseline doing the same, in the bench

    @property
    def needs_text(self) -> str:
        if self.needs is Needs.TRAINED:
            return f"a trained `{self.trained_kind}` drafter"
        return self.needs.value


def _self_methods() -> list[Method]:
    advice = {"int4": "any model of a lean family, no training; its drafts are accepted ~99% of "
                      "the time on the built-in model (its weights are their own 4-bit grid), "
                      "~85% on a model off that grid",
              "int8": "a model off the 4-bit grid (most checkpoints): its drafts kept ~98% of "
                      "the time against int4's ~88%, at ~1.4× int4's cost a token (`verispec "
                      "profile` says; auto picks the format by both)",
              "bf16": "where bfloat16 drafts fastest on this CPU (`verispec profile` says; auto "
                      "picks the fastest format by it)"}
    single = [Method(f"self-{fmt}", f"the target's own weights in {fmt}, its own KV cache", 8,
                     _self(fmt, False), advice[fmt], Needs.SELF, trees=True) for fmt in FORMATS]
    staged = [Method(f"self-{fmt}-pld", f"staged: prompt lookup guesses, the target's own weights "
                     f"in {fmt} check and extend them, the target verifies", 10, _self(fmt, True),
                     "the built-in model in float32, whose weights are their own 4-bit grid: the "
                     "fastest fixed method measured there" if fmt == "int4"
                     else "for comparison with self-int4-pld",
                     Needs.SELF, bench=fmt == "int4") for fmt in FORMATS]
    return [staged[0], *single, *staged[1:]]


METHODS: dict[str, Method] = {m.name: m for m in [
    Method("ar", "nothing: plain autoregressive decoding", 0, None,
           "the reference, or a baseline to compare with"),
    Method("auto", "each step, the drafter and k with the most expected tokens per second by this "
           "machine's cost profile (`verispec profile`) and the acceptance seen so far: suffix "
           "decoding where the text repeats, the target's own low-precision weights (behind prompt "
           "lookup) or a shipped EAGLE drafter elsewhere, plain decoding where nothing pays", 16, _auto,
           "the default: any model, no training; measures the machine once (seconds, cached)"),
    *_self_methods(),
    Method("pld", "prompt lookup: the tokens that followed the context's last n-gram where it "
           "occurred before", 7, _prompt_lookup,
           "answers that copy the prompt (editing code, RAG, summaries); any model",
           trees=True, default_tree=TreeSettings(4, 16), hf_peer="hf-pld"),
    Method("suffix", "suffix decoding: the most frequent continuations of the context's longest "
           "matching suffix, in the request and in the model's earlier outputs (SuffixDecoding)",
           16, _suffix, "repeated or agentic workloads (the same questions, tools, formats again); "
           "any model; the fastest fixed method measured on most targets (docs/tuning.md)", trees=True),
    Method("lookahead", "lookahead decoding: Jacobi iterations in the verifying forward fill an "
           "n-gram pool whose n-grams after the last token are the draft", 2, _lookahead,
           "any model, no training, where a wider forward costs little (GPU); about break-even "
           "on a 2-core CPU"),
    Method("eagle-suffix", "suffix decoding where the text repeats, the EAGLE drafter elsewhere",
           16, _lookup_then("eagle", lambda target, options: _suffix(target, options, "eagle-suffix")),
           "the fastest trained drafter on the built-in model's 4-bit target", Needs.TRAINED,
           EagleDrafter.kind, trees=True,
           shapes=(Shape(None, 1.95, 1), Shape(None, 2.21), Shape(None, 2.34, 3), Shape(None, 2.42, 4),
                   Shape(None, 2.45, 5), Shape(TreeSettings(2, 3), 2.23),
                   Shape(TreeSettings(2, 4), 2.33))),
    Method("eagle-pld", "prompt lookup where the context repeats, the EAGLE drafter elsewhere", 7,
           _lookup_then("eagle", _prompt_lookup),
           "the fastest trained drafter on the built-in model in float32",
           Needs.TRAINED, EagleDrafter.kind, trees=True, default_tree=TreeSettings(2, 3),
           shapes=(Shape(None, 1.99, 1), Shape(None, 2.23), Shape(None, 2.36, 3), Shape(None, 2.43, 4),
                   Shape(None, 2.46, 5), Shape(TreeSettings(2, 3), 2.35),
                   Shape(TreeSettings(2, 4), 2.42))),
    Method("eagle", "one trained decoder layer that predicts the target's next hidden state "
           "(EAGLE)", 2, _learned(EagleDrafter.kind, lambda path, target, options: EagleDrafter.load(
               path, target.model, options.confidence_threshold, options.tree)),
           "answers that do not copy the prompt, when a trained drafter exists", Needs.TRAINED,
           EagleDrafter.kind, trees=True, default_tree=TreeSettings(2, 3),
           shapes=(Shape(None, 1.64, 1), Shape(None, 2.00), Shape(None, 2.21, 3), Shape(None, 2.34, 4),
                   Shape(None, 2.38, 5), Shape(TreeSettings(2, 3), 2.16),
                   Shape(TreeSettings(2, 4), 2.24))),
    Method("eagle3", "EAGLE-3: three target layers fused, a reduced-vocabulary head", 2,
           _learned(Eagle3Drafter.kind, lambda path, target, options: Eagle3Drafter.load(
               path, target.model, options.confidence_threshold, options.tree)),
           "taking a drafter to vLLM or SGLang (`verispec export`)", Needs.TRAINED,
           Eagle3Drafter.kind, trees=True,
           shapes=(Shape(None, 1.64), Shape(TreeSettings(2, 3), 1.78), Shape(TreeSettings(2, 4), 1.83))),
    Method("medusa", "Medusa-1 heads on the target's last hidden state", 3, _learned(
        MedusaDrafter.kind, lambda path, target, options: MedusaDrafter.load(
            path, target.model, options.tree)),
        "mainly for comparison: about break-even with plain decoding on CPU", Needs.TRAINED,
        MedusaDrafter.kind, trees=True, default_tree=TreeSettings(2, 4)),
    Method("hydra", "Medusa-style heads that also read the tokens drafted before them (Hydra)", 4,
           _learned(HydraDrafter.kind, lambda path, target, options: HydraDrafter.load(
               path, target.model, options.tree)),
           "instead of medusa where drafting is cheap next to the target (GPU, larger target)",
           Needs.TRAINED, HydraDrafter.kind, trees=True, bench=False),
    Method("mtp", "multi-token prediction heads: one decoder layer per future token over the "
           "target's final states (or the trunk of a model pretrained with them, as `bytes`), its "
           "norm and LM head shared; as many drafts as heads", 7, _learned(
               MTPDrafter.kind, lambda path, target, options: MTPDrafter.load(
                   path, target.model, options.tree)),
           "a model trained with MTP heads (`--model bytes`), or to train them (`verispec train mtp`)",
           Needs.TRAINED, MTPDrafter.kind, trees=True, bench=False),
    Method("block", "a trained two-layer decoder that reads the target's states at four layers "
           "and drafts a whole block of tokens in one pass (DFlash-style mask slots)", 4,
           _learned(BlockDrafter.kind, lambda path, target, options: BlockDrafter.load(
               path, target.model, options.tree)),
           "where a drafter pass must be cheap and a wide verify costs little", Needs.TRAINED,
           BlockDrafter.kind, trees=True),
    Method("draft", "an independent small model (with the target's tokenizer or another: its text "
           "carried into the target's tokens), or a distilled student", 5, _draft_model,
           "you have a small model of the same family (on CPU its figures: docs/benchmarks.md)",
           Needs.DRAFT_MODEL, DraftStudent.kind, trees=True, hf_peer="hf-assisted"),
    Method("early-exit", "the target's own first layers, through a trained exit when one exists "
           "(LayerSkip-style)", 5, _early_exit, "no other drafter fits (on CPU its figures: "
           "docs/benchmarks.md)", trained_kind=ExitAdapter.kind, trees=True, hf_peer="hf-early-exit"),
]}

TREE_METHODS = tuple(name for name, method in METHODS.items() if method.trees)

# What `generate`, `demo` and `serve` run unless told otherwise: chosen per step by the machine's
# cost profile (docs/tuning.md, "auto"; the measurements behind the fixed methods are there too).
DEFAULT_METHOD = "auto"
# What beam search drafts with (it drafts chains with drafters that fork: not `auto`).
BEAM_DEFAULT = "pld"
PLAIN = "ar"  # no speculation
# Hugging Face generate()'s keywords that choose a method (verispec.generate takes them too).
HF_SELECTORS = {"assistant_model": "draft", "prompt_lookup_num_tokens": "pld",
                "assistant_early_exit": "early-exit"}
# What `verispec bench --batch-size` runs unless --methods says otherwise.
BATCH_BENCH = ("pld", "self-int4-pld", "eagle-pld")


def methods_table() -> str:
    """The README's method table, in markdown, from the records."""
    rows = ["| method | what drafts | needs | k | use it when |", "| :--- | :--- | :--- | ---: | :--- |"]
    rows += [f"| `{m.name}` | {m.description} | {m.needs_text} | {m.default_k} | {m.use_when} |"
             for m in METHODS.values()]
    return "\n".join(rows)


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


def resolve(method: str, options: DraftOptions = DraftOptions()) -> DraftOptions:
    """Check a method name and its options once (the request path's only check); the options
    with the tree resolved (verispec.request.Request.options)."""
    if method not in METHODS:
        raise VerispecError(f"unknown method {method!r}; choose from {', '.join(METHODS)}", field="method")
    k = options.k
    if k is not None and (isinstance(k, bool) or not isinstance(k, int) or k < 0):
        raise VerispecError(f"draft length k must be an integer >= 0 (0: no drafting), got {k!r}", field="k")
    depth = options.model_k
    if depth is not None and (isinstance(depth, bool) or not isinstance(depth, int) or depth < 1):
        raise VerispecError(f"model_k must be an integer >= 1, got {depth!r}", field="model_k")
    if options.schedule not in SCHEDULES:
        raise VerispecError(
            f"unknown draft-length schedule {options.schedule!r}; choose from {', '.join(SCHEDULES)}")
    verifier_for(SamplingParams(), options.acceptance)
    try:
        return replace(options, tree=resolve_tree(method, options.tree))
    except VerispecError as error:
        error.field = error.field or "tree"
        raise


def speculation_for_checked(target: LoadedModel, method: str, options: DraftOptions) -> Speculation:
    """How sequences speculate with `method` on `target` (a drafter, a way to make more, the
    draft-length policy, the acceptance rule); checks nothing: the options are `resolve`'s."""
    spec = METHODS[method]
    if spec.build is None or options.k == 0:
        return Speculation(acceptance=options.acceptance)
    options = shaped(target, method, options)
    k = spec.default_k if options.k is None else options.k
    return Speculation(spec.build(target, options), SCHEDULES[options.schedule](k), options.acceptance,
                       lambda: spec.build(target, options))


def engine_for_checked(target: LoadedModel, method: str, options: DraftOptions) -> SpeculativeEngine:
    """An engine for `target` speculating with `method`; checks nothing: the options are
    `resolve`'s (a Request's)."""
    how = speculation_for_checked(target, method, options)
    return SpeculativeEngine(target.model, how.drafter, how.policy, how.acceptance, how.spawn)


def build_speculation(target: LoadedModel, method: str = "ar",
                      options: DraftOptions = DraftOptions()) -> Speculation:
    """How sequences speculate with `method` on `target`; validates the method and every option
    (for options already checked: speculation_for_checked)."""
    return speculation_for_checked(target, method, resolve(method, options))


def build_engine(target: LoadedModel, method: str = "ar",
                 options: DraftOptions = DraftOptions()) -> SpeculativeEngine:
    """An engine for `target` speculating with `method`; validates the method and every option
    (for options already checked: engine_for_checked)."""
    return engine_for_checked(target, method, resolve(method, options))
