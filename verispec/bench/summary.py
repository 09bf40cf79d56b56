"""Runs to summaries: speedups per label and task, tau, exactness counts, acceptance by draft
position and Leviathan et al.'s speedup model. Pure functions of Run records."""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass

from verispec.bench.records import (
    AR,
    HF,
    OVERALL,
    Cell,
    FirstDifference,
    ForwardTimings,
    MethodSummary,
    Run,
    SpeedupModel,
    is_lossy,
    labels_in_order,
    tasks_in_order,
)
from verispec.core.types import GenerationStats

MAX_BEST_K = 32  # best_k is searched over 1..MAX_BEST_K
TIE_ABSOLUTE = 0.01  # |logit gap| up to this looks like a numerical tie (float32)
TIE_ULPS = 2  # ... or up to this many units in the last place of the logit, in the run's dtype
# spacing at 1.0 (4-bit and GGUF targets' products take bfloat16 activations)
EPSILON = {"float32": 2.0 ** -23, "bfloat16": 2.0 ** -7, "float16": 2.0 ** -10,
           "int4": 2.0 ** -7, "gguf": 2.0 ** -7}


def by_label(runs: Iterable[Run]) -> dict[str, list[Run]]:
    grouped: dict[str, list[Run]] = defaultdict(list)
    for run in runs:
        grouped[run.label].append(run)
    return grouped


def _seconds_by_question(runs: Iterable[Run]) -> dict[tuple[str, int], float]:
    """Seconds per (task, question_id); repeated runs of one question are averaged."""
    times: dict[tuple[str, int], list[float]] = defaultdict(list)
    for run in runs:
        times[(run.task, run.question_id)].append(float(run.seconds))
    return {q: sum(t) / len(t) for q, t in times.items()}


def speedup(runs: list[Run], baseline: list[Run]) -> float | None:
    """Baseline seconds / method seconds, summed over the questions both ran (None if none)."""
    ours, theirs = _seconds_by_question(runs), _seconds_by_question(baseline)
    common = ours.keys() & theirs.keys()
    ours_total = sum(ours[q] for q in common)
    if not common or ours_total <= 0:
        return None
    return sum(theirs[q] for q in common) / ours_total


def cell(runs: list[Run], hf: list[Run], ar: list[Run]) -> Cell:
    """Speedups vs hf and ar, tau (None if any run could not count its forwards), tokens per
    second over all the runs, "n/m" identical to the reference over the runs compared ("-" if
    none), seconds, and under beam search the search steps per target forward."""
    new = sum(r.new_tokens for r in runs)
    seconds = sum(r.seconds for r in runs)
    forwards = [r.target_forwards for r in runs]
    counted = bool(forwards) and all(f is not None for f in forwards) and sum(forwards) > 0
    tau = new / sum(forwards) if counted else None
    per_pass = None
    if counted and all(r.beam_search for r in runs):
        per_pass = sum(r.search_steps for r in runs) / sum(forwards)
    checked = [r.identical_to_baseline for r in runs if r.identical_to_baseline is not None]
    return Cell(speedup(runs, hf), speedup(runs, ar), tau, new / seconds if seconds > 0 else 0.0,
                f"{sum(checked)}/{len(checked)}" if checked else "-", seconds, per_pass)


def summarize(runs: list[Run]) -> list[MethodSummary]:
    """Per label (in report order): a cell per task, then OVERALL.

    >>> runs = [Run(l, l, "qa", 0, None, 10, s, None, baseline=True) for l, s in (("hf", 2.0), ("ar", 1.0))]
    >>> summarize(runs)[1].overall.speedup_vs_hf
    2.0
    """
    grouped = by_label(runs)
    hf, ar = grouped.get(HF, []), grouped.get(AR, [])
    summaries = []
    for label in labels_in_order(runs):
        mine = grouped[label]
        tasks = tasks_in_order(r.task for r in mine)
        cells = {task: cell([r for r in mine if r.task == task], [r for r in hf if r.task == task],
                            [r for r in ar if r.task == task]) for task in tasks}
        cells[OVERALL] = cell(mine, hf, ar)
        summaries.append(MethodSummary(label, mine[0].method, mine[0].baseline, mine[0].k, cells))
    return summaries


def summary_tasks(summaries: Iterable[MethodSummary]) -> list[str]:
    """The tasks that appear in summaries (without OVERALL), in report order."""
    return tasks_in_order(t for s in summaries for t in s.cells if t != OVERALL)


def pooled_stats(runs: Iterable[Run]) -> GenerationStats:
    """The runs' per-position counters and a choosing drafter's stretches summed, as
    GenerationStats holds them."""
    return GenerationStats.total([GenerationStats(
        new_tokens=r.new_tokens, choices=list(r.choices),
        drafted_by_position=list(r.drafted_by_position),
        accepted_by_position=list(r.accepted_by_position),
        reached_by_position=list(r.reached_by_position),
        foreign_tokens=r.foreign_tokens, boundary_lost=r.boundary_lost) for r in runs])


def acceptance_by_position(runs: list[Run], label: str) -> list[float]:
    """Conditional acceptance per draft position, pooled over the label's runs
    (GenerationStats.acceptance_by_position).

    >>> acceptance_by_position([Run("pld", "pld", "qa", 0, 4, 9, 1.0, 5, accepted_by_position=(3, 1),
    ...                             reached_by_position=(4, 3, 1))], "pld")
    [0.75, 0.3333333333333333, 0.0]
    """
    return pooled_stats(r for r in runs if r.label == label).acceptance_by_position


def acceptance_curves(runs: list[Run]) -> dict[str, tuple[list[float], list[int]]]:
    """Per speculative label that drafted: (acceptance by position, times each position was
    reached), in report order."""
    grouped = by_label(runs)
    curves = {}
    for label in labels_in_order(runs):
        if grouped[label][0].baseline:
            continue
        stats = pooled_stats(grouped[label])
        if stats.acceptance_by_position:
            rates = stats.acceptance_by_position
            curves[label] = (rates, stats.reached_by_position[:len(rates)])
    return curves


def leviathan_speedup(alpha: float, k: float, c: float, verify_cost: float = 1.0) -> float:
    """Expected speedup of speculative decoding over plain decoding (Leviathan et al. 2022, Thm 3.8).

    (1 - alpha^(K+1)) / ((1 - alpha) (K c + r)): alpha = acceptance rate per drafted token, K
    drafted tokens per step, c = draft cost per token / target cost per token, r = cost of one
    verify pass over K+1 tokens / cost of one one-token target step (1 in the paper's model, where
    verification is free on parallel hardware). At alpha = 1 the first factor is its limit K+1.

    >>> leviathan_speedup(0.5, 4, 0.0)
    1.9375
    """
    expected_tokens = k + 1 if alpha >= 1 else (1 - alpha ** (k + 1)) / (1 - alpha)
    return expected_tokens / (k * c + verify_cost)


def verify_cost_ratio(by_tokens: dict[str, float], n_tokens: float) -> float | None:
    """Forward time for n_tokens new tokens / for 1 token, linear between the measured counts.

    Beyond the largest measured count the last segment is extended (never below its end value);
    below the smallest the first value is used. None without a one-token measurement.
    """
    points = sorted((int(n), float(s)) for n, s in (by_tokens or {}).items() if s is not None)
    one = dict(points).get(1)
    if not one or one <= 0:
        return None
    if len(points) == 1 or n_tokens <= points[0][0]:
        return points[0][1] / one
    for (n0, s0), (n1, s1) in zip(points, points[1:]):
        if n_tokens <= n1:
            return (s0 + (s1 - s0) * (n_tokens - n0) / (n1 - n0)) / one
    (n0, s0), (n1, s1) = points[-2], points[-1]
    return max(s1, s1 + (s1 - s0) * (n_tokens - n1) / (n1 - n0)) / one


def _best_k(speedup_at: dict[int, float]) -> int:
    return max(speedup_at, key=lambda n: (speedup_at[n], -n))


def speedup_model(runs: list[Run], forward: ForwardTimings | None) -> dict[str, SpeedupModel]:
    """Leviathan et al.'s speedup model per speculative label decoding one path, next to the
    measured speedup vs ar.

    alpha: pooled conditional acceptance, sum(accepted_by_position) / sum(reached_by_position).
    c: (sum draft_seconds / drafted tokens) / (ar seconds / ar new tokens); None without "ar" runs
       or draft timings.
    k: the runs' k; when a label's runs differ in k (or have none), the mean drafted length per
       step that drafted anything, and k_is_mean_drafted_length is True.
    predicted_speedup: the paper's model; predicted_speedup_with_verify_cost also charges the
       measured cost r = by_tokens[K+1] / by_tokens[1] of verifying K+1 tokens at once.
       Tree labels get alpha (per depth) and c but no prediction: the model is for chains.
    best_k / best_k_predicted_speedup: the K in 1..32 that maximizes the paper's model (and the
       same with the verify cost, in best_k_with_verify_cost / ..._predicted_speedup).
    """
    grouped = by_label(runs)
    ar = grouped.get(AR, [])
    ar_new, ar_seconds = sum(r.new_tokens for r in ar), sum(r.seconds for r in ar)
    target_cost = ar_seconds / ar_new if ar and ar_new > 0 else None
    by_tokens = forward.by_tokens if forward else {}
    measured = {s.label: s.overall.speedup_vs_ar for s in summarize(runs)}
    models: dict[str, SpeedupModel] = {}
    for label in labels_in_order(runs):
        mine = grouped[label]
        if mine[0].baseline or mine[0].beam_search:  # the model is for one path
            continue
        stats = pooled_stats(mine)
        reached = sum(stats.reached_by_position)
        alpha = sum(stats.accepted_by_position) / reached if reached > 0 else None
        drafted = sum(stats.drafted_by_position)
        steps = stats.drafted_by_position[0] if stats.drafted_by_position else 0
        draft_seconds = [r.draft_seconds for r in mine]
        c = None
        if target_cost and drafted > 0 and all(s is not None for s in draft_seconds):
            c = (sum(draft_seconds) / drafted) / target_cost
        ks = {r.k for r in mine}
        k_is_mean = len(ks) != 1 or None in ks
        k: float | None = (drafted / steps if steps > 0 else None) if k_is_mean else next(iter(ks))
        found: dict = {}
        tree = mine[0].tree
        if tree is None and alpha is not None and c is not None:
            if k is not None and k > 0:
                found["predicted_speedup"] = leviathan_speedup(alpha, k, c)
                r = verify_cost_ratio(by_tokens, k + 1)
                if r is not None:
                    found["predicted_speedup_with_verify_cost"] = leviathan_speedup(alpha, k, c, r)
            free = {n: leviathan_speedup(alpha, n, c) for n in range(1, MAX_BEST_K + 1)}
            found["best_k"] = _best_k(free)
            found["best_k_predicted_speedup"] = free[found["best_k"]]
            ratios = {n: verify_cost_ratio(by_tokens, n + 1) for n in range(1, MAX_BEST_K + 1)}
            if all(v is not None for v in ratios.values()):
                costly = {n: leviathan_speedup(alpha, n, c, ratios[n]) for n in ratios}
                found["best_k_with_verify_cost"] = _best_k(costly)
                found["best_k_with_verify_cost_predicted_speedup"] = costly[found["best_k_with_verify_cost"]]
        models[label] = SpeedupModel(alpha, c, k, k_is_mean, measured[label], tree, **found)
    return models


def k_sweep_labels(runs: Iterable[Run]) -> dict[str, list[tuple[int, str]]]:
    """Methods benchmarked with at least two different k: {method: [(k, label), ...] sorted by k}."""
    found: dict[str, dict[int, str]] = defaultdict(dict)
    for run in runs:
        if run.k is not None:
            found[run.method].setdefault(int(run.k), run.label)
    return {m: sorted(by_k.items()) for m, by_k in found.items() if len(by_k) >= 2}


@dataclass(frozen=True)
class TreePoint:
    """A tree-capable method's chain or one of its trees, with tau and speedups."""

    label: str
    tree: str | None  # None: the chain
    nodes: int  # draft nodes at most (a chain: k)
    tau: float | None
    speedup_vs_ar: float | None
    vs_chain: float | None  # speedup over the same method's chain (same k), None without one


def tree_sweep(runs: list[Run], summaries: list[MethodSummary]) -> dict[str, list[TreePoint]]:
    """Per method run with trees: its chain and each tree, smallest first."""
    first: dict[str, Run] = {}
    for run in runs:
        first.setdefault(run.label, run)
    overall = {s.label: s.overall for s in summaries}
    out: dict[str, list[TreePoint]] = {}
    for method in dict.fromkeys(r.method for r in first.values() if r.tree):
        points = []
        for label, run in first.items():
            if run.method != method:
                continue
            chain = next((lb for lb, r in first.items() if r.method == method and not r.tree
                          and r.k == run.k and is_lossy(lb) == is_lossy(label)), None)
            mine, chains = overall[label], overall[chain] if chain else None
            nodes = int(run.tree.split("x")[1]) if run.tree else run.k or 0
            vs_chain = None
            if chains and mine.speedup_vs_ar and chains.speedup_vs_ar:
                vs_chain = mine.speedup_vs_ar / chains.speedup_vs_ar
            points.append(TreePoint(label, run.tree, nodes, mine.mean_accepted_tokens,
                                    mine.speedup_vs_ar, vs_chain))
        out[method] = sorted(points, key=lambda p: (p.tree is not None, p.nodes, p.label))
    return out


def logit_ulp(logit: float, dtype: str) -> float:
    """The spacing of `dtype` numbers at the logit's magnitude (0.125 at 17 in bfloat16)."""
    return EPSILON[dtype] * 2.0 ** math.floor(math.log2(max(abs(logit), 1.0)))


def tie_limit(difference: FirstDifference, dtype: str) -> float:
    """The largest logit gap still read as a rounding tie: TIE_ABSOLUTE, or TIE_ULPS units in
    the last place of the baseline token's logit in `dtype` when that is larger (a bfloat16
    logit near 17 moves in steps of 0.125, so two tokens one step apart are tied up to rounding)."""
    if difference.baseline_logit is None:
        return TIE_ABSOLUTE
    return max(TIE_ABSOLUTE, TIE_ULPS * logit_ulp(difference.baseline_logit, dtype))


def looks_like_tie(difference: FirstDifference, dtype: str = "float32") -> bool | None:
    """True when the logit gap at the first difference is small enough to be a float tie
    (see tie_limit). None when no gap was recorded."""
    if difference.logit_gap is None:
        return None
    return abs(difference.logit_gap) <= tie_limit(difference, dtype)


def verdict(run: Run, dtype: str) -> str:
    """Why a run differs from ar, as far as its first difference tells."""
    if run.first_difference is None:
        return "no first difference recorded (lengths differ?)"
    tie = looks_like_tie(run.first_difference, dtype)
    return ("expected: lossy method" if run.lossy else "unknown" if tie is None
            else "likely a numerical tie" if tie else "**not a tie: investigate**")


def differing_runs(runs: list[Run]) -> list[Run]:
    """The runs compared with ar that differ from it: lossless first, in report order."""
    order = {label: i for i, label in enumerate(labels_in_order(runs))}
    tasks = {task: i for i, task in enumerate(tasks_in_order(r.task for r in runs))}
    failed = [r for r in runs if r.identical_to_baseline is False and not r.peer]
    return sorted(failed, key=lambda r: (r.lossy, order[r.label], tasks[r.task], r.question_id))
