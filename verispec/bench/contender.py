"""What a bench run is made of: its configuration, and a contender (a method or a baseline that
turns prompt ids into an Outcome)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from verispec.core.errors import VerispecError
from verispec.core.tree import TreeSettings
from verispec.core.types import GenerationStats
from verispec.decoding.beam import BeamSettings
from verispec.drafters.early_exit import default_exit_layer
from verispec.drafters.learned import drafter_config, is_drafter_dir
from verispec.model.loading import LoadedModel
from verispec.options import DraftOptions


@dataclass(frozen=True)
class BenchConfig:
    model: str
    out: Path
    methods: list[str] | None = None  # None: baselines + every method available for the model
    ks: list[int] | None = None  # None: each method's default
    draft: str | None = None
    trained: list[str] | None = None  # trained drafter directories (eagle, medusa, early-exit)
    exit_layer: int | None = None
    questions: Path | None = None  # None: the built-in prompts
    tasks: list[str] | None = None
    limit_per_task: int | None = None
    max_new_tokens: int = 128
    temperature: float = 0.0
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1: off
    seed: int = 0
    warmup: int = 1
    repeats: int = 1  # timed runs of each contender on each question (the median is recorded)
    dtype: str = "float32"
    device: str = "cpu"
    # also run tree-capable methods with these trees (DEFAULT_TREE: each method's own)
    trees: list[TreeSettings | str] | None = None
    typical: bool = False  # also run each method with typical acceptance (lossy; sampling only)
    options: DraftOptions = DraftOptions()  # every other drafting setting, for every method
    # Beam search (--num-beams B > 1): every contender searches with B beams, Hugging Face's
    # generate(num_beams=B) is the reference. None: one path each.
    beams: BeamSettings | None = None


@dataclass
class Outcome:
    tokens: list[int]
    seconds: float
    target_forwards: int | None  # None where it cannot be counted
    stats: GenerationStats | None = None
    peak_rss_mib: float | None = None  # the process's most resident memory during the run
    search_steps: int | None = None  # beam search: search steps taken (None: one path)


@dataclass(frozen=True)
class Contender:
    label: str
    method: str
    k: int | None
    generate: Callable[[list[int]], Outcome] = field(compare=False)
    tree: str | None = None  # "TOPKxNODES" for a tree drafter
    drafter: str | None = None  # what the drafter runs, where it says (low-precision kernels...)
    weights_mib: float | None = None  # the drafter's own weights, where it reports them
    baseline: bool = False  # a baseline (plain decoding, Hugging Face generate()...)
    peer: bool = False  # another engine with its own arithmetic (llama.cpp): agreement, not identity
    # Ends what runs it (a baseline's child process); None: nothing to end.
    close: Callable[[], None] | None = field(default=None, compare=False)


def trained_drafters(config: BenchConfig) -> dict[str, str]:
    """--trained directories by drafter kind."""
    found: dict[str, str] = {}
    for path in config.trained or []:
        if not is_drafter_dir(path):
            raise VerispecError(f"--trained {path} is not a trained verispec drafter directory")
        kind = drafter_config(path)["kind"]
        if kind in found:
            raise VerispecError(f"--trained names two {kind} drafters: {found[kind]} and {path}")
        found[kind] = path
    return found


def exit_layer(target: LoadedModel, config: BenchConfig) -> int:
    """The layer both early-exit methods use, so verispec and HF are compared like for like."""
    return default_exit_layer(target.model) if config.exit_layer is None else config.exit_layer
