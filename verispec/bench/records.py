"""The bench's data: a Run per contender and question, the summaries made from runs, and
results.json written from them (dataclasses.asdict) and read back (older files included)."""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from verispec.bench.questions import TASKS
from verispec.decoding.beam import BeamSettings
from verispec.methods import PLAIN

HF = "hf"  # Hugging Face generate(): the baseline speedups are given against
AR = PLAIN  # verispec's plain decoding: the reference outputs are compared with (one path)
OVERALL = "overall"  # the summary's key for all tasks together


@dataclass(frozen=True)
class FirstDifference:
    """Where an output parts from `ar`'s, and the target's logit gap between the two tokens there
    (None where the outputs only differ in length)."""

    position: int
    ours: int | None
    baseline: int | None
    logit_gap: float | None = None
    baseline_logit: float | None = None


@dataclass(frozen=True)
class Run:
    """One contender on one question."""

    method: str
    label: str  # the method with its variant: "pld k=4", "pld tree=3x8 typical"
    task: str
    question_id: int
    k: int | None
    new_tokens: int
    seconds: float  # with --repeats N: the median of the N runs' seconds
    target_forwards: int | None  # None where it cannot be counted
    tree: str | None = None  # "TOPKxNODES" for a tree
    repeat_seconds: tuple[float, ...] = ()  # with --repeats N > 1: each run's seconds, in order
    baseline: bool = False  # a baseline (hf*, ar, ...), not a speculative method
    # Another engine with its own kernels (llama.cpp): its agreement with ar is reported, not
    # required, so its differences are not exactness failures.
    peer: bool = False
    drafted_by_position: tuple[int, ...] = ()  # as GenerationStats counts them
    accepted_by_position: tuple[int, ...] = ()
    reached_by_position: tuple[int, ...] = ()
    draft_seconds: float | None = None
    verify_seconds: float | None = None
    identical_to_baseline: bool | None = None  # None: not compared (sampling, or ar itself)
    first_difference: FirstDifference | None = None
    peak_rss_mib: float | None = None  # the process's most resident memory during the run
    # Beam search (--num-beams): search steps taken (new_tokens: the best sequence's); None: one path.
    search_steps: int | None = None
    # A draft model with another tokenizer: its own tokens drafted, and those lost at the boundary.
    foreign_tokens: int = 0
    boundary_lost: int = 0
    # A choosing drafter's (auto's) stretches, as GenerationStats.choices: (first new token, method, k).
    choices: tuple[tuple[int, str, int], ...] = ()

    @property
    def mean_accepted_tokens(self) -> float | None:
        return self.new_tokens / self.target_forwards if self.target_forwards else None

    @property
    def beam_search(self) -> bool:
        return self.search_steps is not None

    @property
    def lossy(self) -> bool:
        return is_lossy(self.label)

    def to_json(self) -> dict:
        return asdict(self) | {"mean_accepted_tokens": self.mean_accepted_tokens}

    @classmethod
    def from_json(cls, data: dict) -> Run:
        """A run from results.json; files from before `baseline` was recorded get it from the
        naming rule they were written under (hf* and ar are baselines)."""
        known = {f.name for f in fields(cls)}
        values = {key: value for key, value in data.items() if key in known}
        for key in ("drafted_by_position", "accepted_by_position", "reached_by_position", "repeat_seconds"):
            values[key] = tuple(values.get(key) or ())
        values["choices"] = tuple(tuple(choice) for choice in values.get("choices") or ())
        if values.get("first_difference"):
            values["first_difference"] = FirstDifference(**values["first_difference"])
        values.setdefault("baseline", data["method"] == AR or data["method"].startswith(HF))
        return cls(**values)


@dataclass(frozen=True)
class Cell:
    """One label on one task (or overall): speedups are ratios of summed seconds over the
    questions both ran (Spec-Bench's convention), None without the baseline."""

    speedup_vs_hf: float | None
    speedup_vs_ar: float | None
    mean_accepted_tokens: float | None  # tau; None if a run could not count its forwards
    tokens_per_second: float
    identical: str  # "n/m": runs identical to the reference among those compared; "-" if none was
    seconds: float = 0.0  # summed over the runs
    search_steps_per_pass: float | None = None  # beam search: search steps per target forward


@dataclass(frozen=True)
class MethodSummary:
    """One label's cells, per task in report order, then OVERALL."""

    label: str
    method: str
    baseline: bool
    k: int | None
    cells: dict[str, Cell]

    @property
    def overall(self) -> Cell:
        return self.cells[OVERALL]

    @property
    def lossy(self) -> bool:
        return is_lossy(self.label)


@dataclass(frozen=True)
class SpeedupModel:
    """Leviathan et al.'s speedup model for one speculative label beside its measured speedup
    (see summary.speedup_model for how each number is made)."""

    alpha: float | None  # pooled conditional acceptance per drafted token
    c: float | None  # draft cost per drafted token / ar's cost per token
    k: float | None
    k_is_mean_drafted_length: bool
    measured_speedup_vs_ar: float | None
    tree: str | None = None  # a tree: measured only, the chain model does not describe it
    predicted_speedup: float | None = None
    predicted_speedup_with_verify_cost: float | None = None
    best_k: int | None = None
    best_k_predicted_speedup: float | None = None
    best_k_with_verify_cost: int | None = None
    best_k_with_verify_cost_predicted_speedup: float | None = None


@dataclass(frozen=True)
class ForwardTimings:
    """Median seconds of one target forward over n new tokens (keys "1", "2", ...) with a cached
    context, as the engine runs it and through the model's own linear layers."""

    by_tokens: dict[str, float]
    unpacked_by_tokens: dict[str, float] | None = None  # None: the engine runs the same layers
    lean: bool = False  # the engine's packed path is verispec.model.lean (else verispec.model.packed)
    context_tokens: int | None = None

    @property
    def bare_forward_seconds(self) -> float | None:
        return self.by_tokens.get("1")

    def to_json(self) -> dict:
        return {key: value for key, value in asdict(self).items() if value is not None} | {
            "bare_forward_seconds": self.bare_forward_seconds}

    @classmethod
    def from_json(cls, data: dict | None) -> ForwardTimings | None:
        if not data or not data.get("by_tokens"):
            return None
        return cls(data["by_tokens"], data.get("unpacked_by_tokens"), bool(data.get("lean")),
                   data.get("context_tokens"))


@dataclass
class Results:
    """A bench's results: how it ran (`config`, `machine`: free-form provenance), the target's
    forward timings and the runs (report.results_json adds the summaries)."""

    config: dict = field(default_factory=dict)
    machine: dict = field(default_factory=dict)
    forward: ForwardTimings | None = None
    runs: list[Run] = field(default_factory=list)

    @property
    def interrupted(self) -> bool:
        return bool(self.config.get("interrupted"))

    @property
    def beams(self) -> BeamSettings | None:
        """The beam search every contender ran (--num-beams > 1); None: one path each."""
        settings = self.config.get("beams")
        return BeamSettings(**settings) if settings else None

    @property
    def reference(self) -> str:
        """The label outputs are compared with, token for token: under beam search Hugging
        Face's `generate(num_beams=B)` (the issue's reference), else verispec's `ar`."""
        return HF if self.beams else AR

    @classmethod
    def from_json(cls, data: dict) -> Results:
        return cls(data.get("config") or {}, data.get("machine") or {},
                   ForwardTimings.from_json(data.get("forward")),
                   [Run.from_json(run) for run in data.get("runs") or []])

    @classmethod
    def load(cls, path: Path) -> Results:
        return cls.from_json(json.loads(Path(path).read_text()))


def is_lossy(label: str) -> bool:
    """Typical and distance ("tv:X") acceptance change the output distribution: such labels are
    marked lossy."""
    return "typical" in label or "tv:" in label


def display_label(label: str) -> str:
    """The label as shown to readers: lossy methods carry "(lossy)"."""
    return f"{label} (lossy)" if is_lossy(label) else label


def labels_in_order(runs: Iterable[Run]) -> list[str]:
    """Labels ordered hf, the other baselines, ar, then the rest by first appearance of their
    method, then k."""
    first_seen: dict[str, int] = {}
    first: dict[str, Run] = {}
    for run in runs:
        first.setdefault(run.label, run)
        first_seen.setdefault(run.method, len(first_seen))

    def key(label: str) -> tuple:
        run = first[label]
        group = 0 if label == HF else 2 if run.method == AR else 1 if run.baseline else 3
        return (group, first_seen[run.method], math.inf if run.k is None else float(run.k), label)

    return sorted(first, key=key)


def tasks_in_order(tasks: Iterable[str]) -> list[str]:
    """The Spec-Bench tasks first, in their usual order, then any others in first-seen order."""
    seen = list(dict.fromkeys(tasks))
    return [t for t in TASKS if t in seen] + [t for t in seen if t not in TASKS]
