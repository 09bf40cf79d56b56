"""DraftOptions: every drafting setting, declared once.

Each field carries its help text and how its command-line value is read (`Flag`); the command
line derives its flags from these fields (verispec.cli.options), so a new setting is one field
here. Which method uses a setting is in its help; methods ignore the settings they do not use.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any

from verispec.core.errors import VerispecError
from verispec.core.policies import SCHEDULES
from verispec.core.tree import TreeSettings
from verispec.drafters.self_spec import SelfSettings
from verispec.drafters.suffix import SuffixSettings
from verispec.model.loading import LoadedModel
from verispec.verifiers import check_acceptance

DEFAULT_TREE = "default"  # DraftOptions.tree: the method's own measured default tree


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


def parse_ints(text: str) -> tuple[int, ...]:
    """'28,29' -> (28, 29)."""
    try:
        return tuple(int(item) for item in text.split(",") if item.strip())
    except ValueError:
        raise VerispecError(f"expected integers separated by commas, got {text!r}") from None


@dataclass(frozen=True)
class Flag:
    """How a DraftOptions field reads from the command line."""

    help: str
    parse: Callable[[str], Any] | None = None  # text -> value; None: a boolean --x / --no-x
    choices: tuple[str, ...] | None = None
    metavar: str | None = None
    bare: Any = None  # the value of the flag given alone (no argument), where that is allowed


def option(default: Any, flag: Flag) -> Any:
    return field(default=default, metadata={"flag": flag})


@dataclass(frozen=True)
class DraftOptions:
    """Every method setting, with its default; unset k means the method's own default."""

    k: int | None = option(None, Flag(
        "tokens drafted per step (0: no drafting; default: the method's); clamped to what fits",
        int))
    schedule: str = option("constant", Flag(
        "draft length: constant k, or heuristic (Hugging Face's: +2 after a full accept, -1 "
        "otherwise)", str, tuple(SCHEDULES)))
    model_k: int | None = option(None, Flag(
        "eagle-pld, eagle-suffix: the most tokens EAGLE drafts where the lookup offers none "
        "(default: the depth this machine's cost profile makes fastest, else EAGLE's k)", int))
    confidence_threshold: float | None = option(None, Flag(
        "model drafters stop drafting when their probability for the drafted token falls below "
        "this", float))
    # A LoadedModel where the API passes one.
    draft: str | LoadedModel | None = option(None, Flag(
        "for draft: a draft model (name, directory or .gguf) or a distilled student; for a "
        "trained method (eagle, medusa, hydra, mtp, block, early-exit, ...): a trained drafter "
        "directory from `verispec train` (default: the one shipped for the model)", str,
        metavar="PATH"))
    exit_layer: int | None = option(None, Flag(
        "early-exit: layers used to draft (default: the trained exit's, else half)", int))
    max_ngram: int = option(4, Flag("prompt lookup: longest n-gram matched (tried first)", int))
    min_ngram: int = option(2, Flag("prompt lookup: shortest n-gram matched", int))
    tree: TreeSettings | str | None = option(None, Flag(
        "draft a token tree of depth k instead of a chain (TOPKxNODES, e.g. 4x16: top-k children "
        "per expanded node, NODES draft nodes in all); alone: the method's default tree; unset "
        "(and no --k), eagle, eagle-pld, eagle-suffix and eagle3 with their shipped drafter draft the "
        "chain (and its depth) or tree this machine's cost profile makes fastest",
        parse_tree, metavar="TOPKxNODES", bare=DEFAULT_TREE))
    acceptance: str = option("exact", Flag(
        "exact (default, lossless); typical: Medusa's typical acceptance, LOSSY under sampling; "
        "tv:X (e.g. tv:0.1): keep a draft token outright where draft and target are within total "
        "variation X, LOSSY under sampling (the output no longer follows the target's "
        "distribution; under greedy decoding both are exact)", check_acceptance, metavar="RULE"))
    group: int = option(SelfSettings.group, Flag(
        "self-int4: input columns sharing one scale (32, 64 or 128)", int))
    skip_layers: tuple[int, ...] = option(SelfSettings.skip, Flag(
        "self-*: decoder layers the low-precision drafter leaves out (default: none)", parse_ints,
        metavar="I,J,..."))
    lookahead_window: int = option(2, Flag(
        "lookahead: W, guesses in the Jacobi window per iteration", int, metavar="W"))
    lookahead_ngram: int | None = option(None, Flag(
        "lookahead: N, the n-gram size; drafts min(k, N - 1) tokens per n-gram (default: k + 1)",
        int, metavar="N"))
    lookahead_guesses: int = option(2, Flag(
        "lookahead: G, pooled n-grams kept and verified per first token", int, metavar="G"))
    lookahead_pool_context: bool = option(True, Flag(
        "lookahead: also pool the n-grams of the prompt and output"))
    suffix_factor: float = option(SuffixSettings.factor, Flag(
        "suffix: tokens drafted per matched token (the draft follows the match's length, at most "
        "k)", float))
    suffix_min_prob: float = option(SuffixSettings.min_prob, Flag(
        "suffix: the least frequency a drafted continuation may have among those seen", float))
    suffix_cache_tokens: int = option(SuffixSettings.cache_tokens, Flag(
        "suffix: tokens of earlier outputs kept for every request of the model, least recently "
        "used evicted (0: the request's own tokens only)", int, metavar="N"))


def option_flags() -> list[tuple[str, Any, Flag]]:
    """(field name, default, Flag) for every DraftOptions field, in declaration order."""
    return [(f.name, f.default, f.metadata["flag"]) for f in fields(DraftOptions)]
