"""Benchmark reporting: pure functions from run records to a summary, a theory check, Markdown.

A run record is one dict per (label, question), written by the runner:

    {"method": "pld", "label": "pld k=8", "task": "qa", "question_id": 3, "k": 8,
     "new_tokens": 128, "seconds": 4.1, "target_forwards": 52, "mean_accepted_tokens": 2.46,
     "drafted_by_position": [...], "accepted_by_position": [...], "reached_by_position": [...],
     "draft_seconds": 0.02, "verify_seconds": 3.9,
     "identical_to_baseline": True, "first_difference": None}

Baselines are the labels "hf" (Hugging Face generate()) and "ar" (verispec plain decoding). Methods
whose name starts with "hf" are Hugging Face baselines, "ar" is plain decoding, and every other
method is speculative. A label containing "typical" is shown with "(lossy)" everywhere.

Speedups follow Spec-Bench: a ratio of sums of wall-clock seconds, over the questions that both the
method and the baseline ran. Nothing here imports matplotlib; `write_report` loads `plots` when it
draws.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable
from pathlib import Path

from verispec.bench.questions import TASKS

HF_LABEL = "hf"
AR_LABEL = "ar"
OVERALL = "overall"
SPEC_BENCH_TASKS = TASKS  # Spec-Bench order first, then any other task
REPORT_FILE = "report.md"
SPEEDUP_PNG = "speedup_by_task.png"
ACCEPTANCE_PNG = "acceptance_by_position.png"
K_SWEEP_PNG = "k_sweep.png"
MAX_BEST_K = 32  # best_k is searched over 1..MAX_BEST_K
DISAGREEMENT = 0.20  # theory vs measurement flagged beyond this relative difference
TIE_ABSOLUTE = 0.01  # |logit gap| up to this looks like a numerical tie (float32)
TIE_ULPS = 2  # ... or up to this many units in the last place of the logit, in the run's dtype
EPSILON = {"float32": 2.0 ** -23, "bfloat16": 2.0 ** -7, "float16": 2.0 ** -10}  # spacing at 1.0

Run = dict  # one run record, as described in the module docstring


# ---------------------------------------------------------------------------------------------
# names and ordering


def is_baseline_method(method: str) -> bool:
    """True for Hugging Face generate() baselines ("hf", "hf-pld", ...) and plain decoding "ar"."""
    return method.startswith("hf") or method == AR_LABEL


def is_speculative_method(method: str) -> bool:
    """True for verispec speculative methods: every method that is not hf* and not ar."""
    return not is_baseline_method(method)


def is_lossy(label: str) -> bool:
    """Typical acceptance changes the output distribution: such labels are marked lossy."""
    return "typical" in label


def display_label(label: str) -> str:
    """The label as shown to readers: lossy methods carry "(lossy)"."""
    return f"{label} (lossy)" if is_lossy(label) else label


def labels_in_order(runs: Iterable[Run]) -> list[str]:
    """Labels ordered hf, other hf*, ar, then the rest by first appearance of their method, then k."""
    first_seen: dict[str, int] = {}
    method_of: dict[str, str] = {}
    k_of: dict[str, float] = {}
    for run in runs:
        label, method = run["label"], run["method"]
        method_of.setdefault(label, method)
        first_seen.setdefault(method, len(first_seen))
        k = run.get("k")
        k_of.setdefault(label, math.inf if k is None else float(k))

    def key(label: str) -> tuple:
        method = method_of[label]
        group = 0 if label == HF_LABEL else 1 if method.startswith("hf") else 2 if method == AR_LABEL else 3
        return (group, first_seen[method], k_of[label], label)

    return sorted(method_of, key=key)


def tasks_in_order(tasks: Iterable[str]) -> list[str]:
    """The Spec-Bench tasks first, in their usual order, then any others in first-seen order."""
    seen = list(dict.fromkeys(tasks))
    return [t for t in SPEC_BENCH_TASKS if t in seen] + [t for t in seen if t not in SPEC_BENCH_TASKS]


def _by_label(runs: Iterable[Run]) -> dict[str, list[Run]]:
    grouped: dict[str, list[Run]] = defaultdict(list)
    for run in runs:
        grouped[run["label"]].append(run)
    return grouped


# ---------------------------------------------------------------------------------------------
# summary


def _seconds_by_question(runs: Iterable[Run]) -> dict[tuple[str, int], float]:
    """Seconds per (task, question_id); repeated runs of one question are averaged."""
    times: dict[tuple[str, int], list[float]] = defaultdict(list)
    for run in runs:
        times[(run["task"], run["question_id"])].append(float(run["seconds"]))
    return {q: sum(t) / len(t) for q, t in times.items()}


def _speedup(method_runs: list[Run], baseline_runs: list[Run] | None) -> float | None:
    """Baseline seconds / method seconds, summed over the questions both ran (None if none)."""
    if not baseline_runs:
        return None
    ours, theirs = _seconds_by_question(method_runs), _seconds_by_question(baseline_runs)
    common = ours.keys() & theirs.keys()
    ours_total = sum(ours[q] for q in common)
    if not common or ours_total <= 0:
        return None
    return sum(theirs[q] for q in common) / ours_total


def _cell(runs: list[Run], hf: list[Run] | None, ar: list[Run] | None) -> dict:
    new = sum(r["new_tokens"] for r in runs)
    seconds = sum(r["seconds"] for r in runs)
    forwards = [r.get("target_forwards") for r in runs]
    tau = None
    if forwards and all(f is not None for f in forwards) and sum(forwards) > 0:
        tau = new / sum(forwards)
    checked = [r["identical_to_baseline"] for r in runs if r.get("identical_to_baseline") is not None]
    return {
        "speedup_vs_hf": _speedup(runs, hf),
        "speedup_vs_ar": _speedup(runs, ar),
        "mean_accepted_tokens": tau,
        "tokens_per_second": new / seconds if seconds > 0 else 0.0,
        "identical": f"{sum(bool(c) for c in checked)}/{len(checked)}" if checked else "-",
    }


def summarize(runs: list[Run]) -> dict:
    """Per label and task (plus "overall"): speedups vs hf and ar, tau, tokens/s, identical "n/m".

    Speedups are ratios of summed seconds over the questions present for both the label and the
    baseline; None when the baseline is absent. tau (mean accepted tokens) = sum new_tokens / sum
    target_forwards, None if any run could not count its forwards. tokens_per_second = sum new /
    sum seconds over all the label's runs. "identical" counts identical_to_baseline True over the
    runs where it is not None ("-" if none).

    >>> runs = [dict(label=l, method=l, task="qa", question_id=0, new_tokens=10, seconds=s,
    ...              target_forwards=None) for l, s in (("hf", 2.0), ("ar", 1.0))]
    >>> summarize(runs)["ar"]["overall"]["speedup_vs_hf"]
    2.0
    """
    grouped = _by_label(runs)
    hf, ar = grouped.get(HF_LABEL), grouped.get(AR_LABEL)
    summary: dict = {}
    for label in labels_in_order(runs):
        label_runs = grouped[label]
        by_task: dict[str, list[Run]] = defaultdict(list)
        for run in label_runs:
            by_task[run["task"]].append(run)
        summary[label] = {
            task: _cell(by_task[task],
                        [r for r in hf if r["task"] == task] if hf else None,
                        [r for r in ar if r["task"] == task] if ar else None)
            for task in tasks_in_order(by_task)
        }
        summary[label][OVERALL] = _cell(label_runs, hf, ar)
    return summary


def summary_tasks(summary: dict) -> list[str]:
    """The tasks that appear in a summary (without "overall"), in report order."""
    return tasks_in_order(t for cells in summary.values() for t in cells if t != OVERALL)


# ---------------------------------------------------------------------------------------------
# acceptance and theory


def _sum_lists(lists: Iterable[list[int]]) -> list[int]:
    total: list[int] = []
    for values in lists:
        values = values or []
        total.extend([0] * (len(values) - len(total)))
        for i, v in enumerate(values):
            total[i] += v
    return total


def position_counts(runs: list[Run], label: str) -> dict[str, list[int]]:
    """{"drafted", "accepted", "reached"}: per-position counts summed over the label's runs."""
    mine = [r for r in runs if r["label"] == label]
    counts = {name: _sum_lists(r.get(f"{name}_by_position") for r in mine)
              for name in ("drafted", "accepted", "reached")}
    width = max(len(v) for v in counts.values())
    return {name: v + [0] * (width - len(v)) for name, v in counts.items()}


def acceptance_by_position(runs: list[Run], label: str) -> list[float]:
    """Conditional acceptance per draft position, pooled over the label's runs.

    Entry i = accepted_i / reached_i: the chance position i is accepted given that it was drafted
    and positions 0..i-1 were accepted. The list stops before the first position never reached.

    >>> acceptance_by_position([{"label": "pld", "accepted_by_position": [3, 1, 0],
    ...                          "reached_by_position": [4, 3, 1]}], "pld")
    [0.75, 0.3333333333333333, 0.0]
    """
    counts = position_counts(runs, label)
    rates = []
    for a, n in zip(counts["accepted"], counts["reached"]):
        if n <= 0:
            break
        rates.append(a / n)
    return rates


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


def verify_cost_ratio(by_tokens: dict, n_tokens: float) -> float | None:
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


def theory(runs: list[Run], forward: dict | None) -> dict:
    """Leviathan et al.'s speedup model per speculative label, next to the measured speedup vs ar.

    alpha: pooled conditional acceptance, sum(accepted_by_position) / sum(reached_by_position).
    c: (sum draft_seconds / drafted tokens) / (ar seconds / ar new tokens); None without "ar" runs
       or draft timings.
    k: the runs' k; when a label's runs differ in k (or have none), the mean drafted length per
       step that drafted anything, and "k_is_mean_drafted_length" is True.
    predicted_speedup: the paper's model; predicted_speedup_with_verify_cost also charges the
       measured cost r = by_tokens[K+1] / by_tokens[1] of verifying K+1 tokens at once.
       Tree labels ("tree" set) get alpha (per depth) and c but no prediction: the model is for chains.
    best_k / best_k_predicted_speedup: the K in 1..32 that maximizes the paper's model (and the
       same with the verify cost, in best_k_with_verify_cost / ..._predicted_speedup).
    """
    grouped = _by_label(runs)
    ar = grouped.get(AR_LABEL, [])
    ar_new, ar_seconds = sum(r["new_tokens"] for r in ar), sum(r["seconds"] for r in ar)
    target_cost = ar_seconds / ar_new if ar and ar_new > 0 else None
    by_tokens = (forward or {}).get("by_tokens") or {}
    measured = summarize(runs)

    out: dict = {}
    for label in labels_in_order(runs):
        mine = grouped[label]
        if not is_speculative_method(mine[0]["method"]):
            continue
        accepted = sum(sum(r.get("accepted_by_position") or []) for r in mine)
        reached = sum(sum(r.get("reached_by_position") or []) for r in mine)
        drafted_lists = _sum_lists(r.get("drafted_by_position") for r in mine)
        drafted, steps = sum(drafted_lists), (drafted_lists[0] if drafted_lists else 0)
        alpha = accepted / reached if reached > 0 else None

        draft_seconds = [r.get("draft_seconds") for r in mine]
        c = None
        if target_cost and drafted > 0 and all(s is not None for s in draft_seconds):
            c = (sum(draft_seconds) / drafted) / target_cost

        ks = {r.get("k") for r in mine}
        k_is_mean = len(ks) != 1 or None in ks
        k: float | None = (drafted / steps if steps > 0 else None) if k_is_mean else next(iter(ks))

        entry = {"alpha": alpha, "c": c, "k": k, "k_is_mean_drafted_length": k_is_mean,
                 "predicted_speedup": None, "predicted_speedup_with_verify_cost": None,
                 "measured_speedup_vs_ar": measured[label][OVERALL]["speedup_vs_ar"],
                 "best_k": None, "best_k_predicted_speedup": None,
                 "best_k_with_verify_cost": None, "best_k_with_verify_cost_predicted_speedup": None}
        entry["tree"] = mine[0].get("tree")
        if entry["tree"] is not None:  # the chain model does not describe a tree: measured only
            out[label] = entry
            continue
        if alpha is not None and c is not None:
            if k is not None and k > 0:
                entry["predicted_speedup"] = leviathan_speedup(alpha, k, c)
                r = verify_cost_ratio(by_tokens, k + 1)
                if r is not None:
                    entry["predicted_speedup_with_verify_cost"] = leviathan_speedup(alpha, k, c, r)
            model = {n: leviathan_speedup(alpha, n, c) for n in range(1, MAX_BEST_K + 1)}
            entry["best_k"] = max(model, key=lambda n: (model[n], -n))
            entry["best_k_predicted_speedup"] = model[entry["best_k"]]
            ratios = {n: verify_cost_ratio(by_tokens, n + 1) for n in range(1, MAX_BEST_K + 1)}
            if all(v is not None for v in ratios.values()):
                with_cost = {n: leviathan_speedup(alpha, n, c, ratios[n]) for n in ratios}
                best = max(with_cost, key=lambda n: (with_cost[n], -n))
                entry["best_k_with_verify_cost"] = best
                entry["best_k_with_verify_cost_predicted_speedup"] = with_cost[best]
        out[label] = entry
    return out


def k_sweep_labels(runs: Iterable[Run]) -> dict[str, list[tuple[int, str]]]:
    """Methods benchmarked with at least two different k: {method: [(k, label), ...] sorted by k}."""
    found: dict[str, dict[int, str]] = defaultdict(dict)
    for run in runs:
        if run.get("k") is not None:
            found[run["method"]].setdefault(int(run["k"]), run["label"])
    return {m: sorted(by_k.items()) for m, by_k in found.items() if len(by_k) >= 2}


# ---------------------------------------------------------------------------------------------
# Markdown


def _x(value: float | None) -> str:
    return "–" if value is None else f"{value:.2f}×"


def _f(value: float | None, digits: int = 2) -> str:
    return "–" if value is None else f"{value:.{digits}f}"


def _pct(value: float | None) -> str:
    return "–" if value is None else f"{100 * value:.0f}%"


def _name(label: str) -> str:
    return display_label(label).replace("|", "\\|")


def _is_number(cell: str) -> bool:
    core = cell.strip("*×%+−-–. ").replace(".", "").replace("/", "")
    return core.isdigit() or cell in ("", "–", "-")


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    """A Markdown table; columns holding only numbers are right-aligned."""
    align = [":---" if i == 0 or not all(_is_number(row[i]) for row in rows) else "---:"
             for i in range(len(header))]
    lines = ["| " + " | ".join(header) + " |", "| " + " | ".join(align) + " |"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return lines


def logit_ulp(logit: float, dtype: str) -> float:
    """The spacing of `dtype` numbers at the logit's magnitude (0.125 at 17 in bfloat16)."""
    return EPSILON[dtype] * 2.0 ** math.floor(math.log2(max(abs(logit), 1.0)))


def tie_limit(first_difference: dict, dtype: str) -> float:
    """The largest logit gap still read as a rounding tie: TIE_ABSOLUTE, or TIE_ULPS units in
    the last place of the baseline token's logit in `dtype` when that is larger (a bfloat16
    logit near 17 moves in steps of 0.125, so two tokens one step apart are tied up to rounding)."""
    logit = first_difference.get("baseline_logit")
    if logit is None:
        return TIE_ABSOLUTE
    return max(TIE_ABSOLUTE, TIE_ULPS * logit_ulp(logit, dtype))


def looks_like_tie(first_difference: dict, dtype: str = "float32") -> bool | None:
    """True when the logit gap at the first difference is small enough to be a float tie
    (see tie_limit). None when no gap was recorded."""
    gap = first_difference.get("logit_gap")
    if gap is None:
        return None
    return abs(gap) <= tie_limit(first_difference, dtype)


def _header(results: dict, runs: list[Run]) -> list[str]:
    config, machine = results.get("config") or {}, results.get("machine") or {}
    temperature = config.get("temperature")
    mode = "greedy" if not temperature else "sampling"
    questions: dict[str, set] = defaultdict(set)
    for run in runs:
        questions[run["task"]].add(run["question_id"])
    per_task = ", ".join(f"{t} {len(questions[t])}" for t in tasks_in_order(questions))
    lines = [
        "# verispec benchmark",
        "",
        f"- **model**: {config.get('model', '?')} · **dtype**: {config.get('dtype', '?')}"
        f" · **device**: {config.get('device', '?')}"
        f" · **invariance**: {config.get('invariance', '?')}",
        f"- **max_new_tokens**: {config.get('max_new_tokens', '?')} · **temperature**: {temperature}"
        f" ({mode}) · **seed**: {config.get('seed', '?')} · **warmup**: {config.get('warmup', '?')}",
        f"- **questions per task**: {per_task or 'none'}"
        f" ({sum(len(q) for q in questions.values())} in total)",
    ]
    if machine:
        lines.append("- **machine**: " + ", ".join(f"{k}: {v}" for k, v in machine.items()))
    return lines


def _main_table(summary: dict) -> list[str]:
    tasks = summary_tasks(summary)
    if HF_LABEL in summary:
        key, title = "speedup_vs_hf", "## Speedup over Hugging Face generate()"
        intro = ("Task and overall columns: speedup vs `hf` (Hugging Face `generate()`), the ratio of summed "
                 "wall-clock seconds over the questions both ran (Spec-Bench's convention). `vs ar`: the "
                 "same against verispec's plain decoding.")
    else:
        key, title = "speedup_vs_ar", "## Speedup over plain decoding"
        intro = ("No `hf` runs: task and overall columns show the speedup vs `ar` (verispec's plain "
                 "decoding), the ratio of summed wall-clock seconds over the questions both ran.")
    header = ["method", *tasks, "overall", "vs ar", "τ", "tok/s", "identical"]
    rows = []
    for label, cells in summary.items():
        overall = cells[OVERALL]
        rows.append([_name(label), *[_x(cells[t][key]) if t in cells else "–" for t in tasks],
                     f"**{_x(overall[key])}**", _x(overall["speedup_vs_ar"]),
                     _f(overall["mean_accepted_tokens"]), _f(overall["tokens_per_second"], 1),
                     overall["identical"]])
    intro += (" τ: new tokens per target forward. tok/s: new tokens per second over all the method's runs. "
              "`identical`: runs whose output equals `ar`'s token for token.")
    return [title, "", intro, ""] + _table(header, rows)


def _ar_note(summary: dict, forward: dict | None) -> list[str]:
    bare = (forward or {}).get("bare_forward_seconds")
    if AR_LABEL not in summary or not bare:
        return []
    ar_tps = summary[AR_LABEL][OVERALL]["tokens_per_second"]
    limit = 1.0 / bare
    if ar_tps <= 0:
        return []
    overhead_ms = (1.0 / ar_tps - bare) * 1000
    return ["", f"`ar` runs at {ar_tps:.1f} tok/s against a bare-forward limit of {limit:.1f} tok/s "
            f"(1 / {bare * 1000:.1f} ms, one one-token forward with a cache, timed alone): "
            f"{100 * (1 - ar_tps / limit):.0f}% below it, about {overhead_ms:.1f} ms per token beyond the "
            "forward. That gap is the engine's per-step overhead (prefill time is included in `ar`'s "
            "seconds, so part of it is the prompt)."] + _verify_cost_note(forward)


def _verify_cost_note(forward: dict) -> list[str]:
    """One line: what scoring n tokens in one forward costs, in one-token forwards."""
    by_tokens = {int(n): t for n, t in (forward.get("by_tokens") or {}).items()}
    one = by_tokens.get(1)
    if not one or len(by_tokens) < 2:
        return []
    costs = ", ".join(f"{n}: {t / one:.2f}×" for n, t in sorted(by_tokens.items()) if n > 1)
    lines = ["", f"Verification cost on this machine: one forward over n new tokens costs, in one-token "
             f"forwards, {costs}. Speculation pays only when the tokens a step gains outweigh this."]
    unpacked = {int(n): t for n, t in (forward.get("unpacked_by_tokens") or {}).items()}
    if unpacked.get(1):
        costs = ", ".join(f"{n}: {t / unpacked[1]:.2f}×" for n, t in sorted(unpacked.items()) if n > 1)
        how = ("through verispec.lean (fused prepacked weights, a preallocated KV cache)"
               if forward.get("lean") else "with prepacked linear weights (verispec.packed)")
        lines += ["", f"The engine runs the target {how}. "
                  f"Through the model's own linear layers, as Hugging Face generate() runs it, one "
                  f"token takes {unpacked[1] * 1000:.1f} ms (prepacked: {one * 1000:.1f} ms) and n "
                  f"tokens cost {costs}."]
    return lines


def _theory_section(theo: dict) -> list[str]:
    if not theo:
        return []
    rows, disagree, mean_k = [], [], []
    trees = [_name(label) for label, t in theo.items() if t.get("tree")]
    for label, t in theo.items():
        k = t["k"]
        k_text = "–" if k is None else f"{k:.1f}*" if t["k_is_mean_drafted_length"] else str(k)
        if t.get("tree"):
            k_text = f"{k_text} (tree {t['tree']})"
        if t["k_is_mean_drafted_length"] and k is not None:
            mean_k.append(label)
        best = "–" if t["best_k"] is None else f"{t['best_k']} ({_x(t['best_k_predicted_speedup'])})"
        best_cost = ("–" if t["best_k_with_verify_cost"] is None else
                     f"{t['best_k_with_verify_cost']} ({_x(t['best_k_with_verify_cost_predicted_speedup'])})")
        rows.append([_name(label), _f(t["alpha"]), _f(t["c"], 3), k_text, _x(t["predicted_speedup"]),
                     _x(t["predicted_speedup_with_verify_cost"]), _x(t["measured_speedup_vs_ar"]),
                     best, best_cost])
        predicted = t["predicted_speedup_with_verify_cost"] or t["predicted_speedup"]
        measured = t["measured_speedup_vs_ar"]
        if predicted and measured is not None and abs(measured - predicted) / predicted > DISAGREEMENT:
            disagree.append(f"{_name(label)} (measured {_x(measured)} vs predicted {_x(predicted)}, "
                            f"{100 * (measured / predicted - 1):+.0f}%)")
    lines = ["", "## Theory (Leviathan et al. 2022) vs measurement", "",
             "α: conditional acceptance per drafted token, pooled. c: draft cost per drafted token / `ar`'s "
             "cost per token. predicted = (1 − α^(K+1)) / ((1 − α)(K·c + 1)); with verify cost, the 1 "
             "becomes r = forward time for K+1 tokens / for 1 token, as measured on this machine. "
             "measured: speedup vs `ar`. best K: the K in 1..32 maximizing each model.", ""]
    lines += _table(["method", "α", "c", "K", "predicted", "with verify cost", "measured vs ar",
                     "best K (model)", "best K (with verify cost)"], rows)
    if trees:
        lines += ["", "Tree methods (" + ", ".join(trees) + "): K is the tree depth, α the acceptance "
                  "per depth; the chain model above does not describe a tree, so they are measured only."]
    if mean_k:
        lines += ["", "\\* runs with different K: K is the mean drafted length per drafting step ("
                  + ", ".join(_name(lb) for lb in mean_k) + ")."]
    if disagree:
        lines += ["", "Prediction (with verify cost where measured) and measurement disagree by more than "
                  f"{100 * DISAGREEMENT:.0f}% for: " + "; ".join(disagree) + ". The model assumes "
                  "independent acceptances with a constant α, and ignores per-step overhead and prefill."]
    else:
        lines += ["", f"Every prediction is within {100 * DISAGREEMENT:.0f}% of the measurement."]
    return lines


def _exactness_section(runs: list[Run], greedy: bool, dtype: str) -> list[str]:
    lines = ["", "## Exactness", ""]
    checked = [r for r in runs if r.get("identical_to_baseline") is not None]
    failed = [r for r in checked if r["identical_to_baseline"] is False]
    if not checked:
        reason = ("no comparison was recorded" if greedy else
                  "under sampling only the output distribution is exact, not the tokens")
        return lines + [f"No run was compared with `ar` token for token ({reason})."]
    if not failed:
        return lines + [f"All {len(checked)} compared runs are identical to `ar`, token for token."]
    lossless_failed = [r for r in failed if not is_lossy(r["label"])]
    lines += [f"{len(failed)} of {len(checked)} compared runs differ from `ar`"
              + (f" ({len(failed) - len(lossless_failed)} of them from lossy methods, expected)"
                 if len(lossless_failed) < len(failed) else "") + ". A logit gap at the first difference "
              f"of at most {TIE_ABSOLUTE}, or {TIE_ULPS} units in the last place of the logit in {dtype} "
              "when that is larger, means the two tokens were tied up to rounding (a batched verify "
              "pass rounds differently from one-token decoding); a larger gap points to a bug.", ""]
    rows = []
    order = {label: i for i, label in enumerate(labels_in_order(runs))}
    tasks = {task: i for i, task in enumerate(tasks_in_order(r["task"] for r in runs))}
    for r in sorted(failed, key=lambda r: (is_lossy(r["label"]), order[r["label"]], tasks[r["task"]],
                                           r["question_id"])):
        diff = r.get("first_difference")
        if not diff:
            rows.append([_name(r["label"]), r["task"], str(r["question_id"]), "–", "–", "–", "–",
                         "no first difference recorded (lengths differ?)"])
            continue
        tie = looks_like_tie(diff, dtype)
        verdict = ("expected: lossy method" if is_lossy(r["label"]) else "unknown" if tie is None
                   else "likely a numerical tie" if tie else "**not a tie: investigate**")
        gap = diff.get("logit_gap")
        rows.append([_name(r["label"]), r["task"], str(r["question_id"]), str(diff.get("position")),
                     str(diff.get("ours")), str(diff.get("baseline")),
                     "–" if gap is None else f"{gap:.3g}", verdict])
    return lines + _table(["method", "task", "question", "position", "ours", "baseline", "logit gap",
                           "verdict"], rows)


def _acceptance_section(runs: list[Run], labels: list[str]) -> list[str]:
    rates = {lb: acceptance_by_position(runs, lb) for lb in labels}
    rates = {lb: r for lb, r in rates.items() if r}
    if not rates:
        return []
    width = max(len(r) for r in rates.values())
    rows = [[_name(lb), str(position_counts(runs, lb)["reached"][0]),
             *[_pct(r[i]) if i < len(r) else "–" for i in range(width)]]
            for lb, r in rates.items()]
    intro = ("Chance that draft position i is accepted, given that it was drafted and every earlier "
             "position was accepted, pooled over all questions. `steps`: drafting steps (the sample size "
             "at position 1; later positions are reached less often, so their rates are noisier).")
    header = ["method", "steps", *[str(i + 1) for i in range(width)]]
    return ["", "## Acceptance by draft position", "", intro, ""] + _table(header, rows)


def tree_sweep(runs: list[Run], summary: dict) -> dict[str, list[dict]]:
    """Per method run with trees: its chain and each tree, smallest first, with τ and speedups.

    {method: [{"label", "tree", "nodes", "tau", "speedup_vs_ar", "vs_chain"}, ...]}; "vs_chain" is
    the speedup over the same method's chain label (with the same k), None without one.
    """
    first: dict[str, Run] = {}
    for run in runs:
        first.setdefault(run["label"], run)
    out: dict[str, list[dict]] = {}
    for method in dict.fromkeys(r["method"] for r in first.values() if r.get("tree")):
        entries = []
        for label, run in first.items():
            if run["method"] != method:
                continue
            chain = next((lb for lb, r in first.items() if r["method"] == method and not r.get("tree")
                          and r.get("k") == run.get("k") and is_lossy(lb) == is_lossy(label)), None)
            cell, chain_cell = summary[label][OVERALL], summary[chain][OVERALL] if chain else None
            nodes = int(run["tree"].split("x")[1]) if run.get("tree") else run.get("k") or 0
            vs_chain = None
            if chain_cell and cell["speedup_vs_ar"] and chain_cell["speedup_vs_ar"]:
                vs_chain = cell["speedup_vs_ar"] / chain_cell["speedup_vs_ar"]
            entries.append({"label": label, "tree": run.get("tree"), "nodes": nodes,
                            "tau": cell["mean_accepted_tokens"], "speedup_vs_ar": cell["speedup_vs_ar"],
                            "vs_chain": vs_chain})
        out[method] = sorted(entries, key=lambda e: (e["tree"] is not None, e["nodes"], e["label"]))
    return out


def _tree_section(runs: list[Run], summary: dict) -> list[str]:
    sweep = tree_sweep(runs, summary)
    if not sweep:
        return []
    lines = ["", "## Trees against chains", "",
             "Each tree-capable method's chain beside its trees (TOPKxNODES, depth = K). A bigger "
             "tree adds τ but makes every verification forward longer (more rows scored); "
             "`vs chain` shows where that stops paying on this machine.", ""]
    rows = []
    for entries in sweep.values():
        for e in entries:
            rows.append([_name(e["label"]), "chain" if e["tree"] is None else e["tree"],
                         str(e["nodes"]), _f(e["tau"]), _x(e["speedup_vs_ar"]), _x(e["vs_chain"])])
    return lines + _table(["method", "shape", "draft nodes (max)", "τ", "vs ar", "vs chain"], rows)


def expected_figures(runs: list[Run], summary: dict) -> list[str]:
    """File names of the figures `write_report` draws for these runs (same rules as `plots`)."""
    names = []
    if any(c[OVERALL]["speedup_vs_hf"] is not None for lb, c in summary.items() if lb != HF_LABEL):
        names.append(SPEEDUP_PNG)
    labels = {r["label"] for r in runs if is_speculative_method(r["method"])}
    if any(acceptance_by_position(runs, lb) for lb in labels):
        names.append(ACCEPTANCE_PNG)
    if k_sweep_labels(runs):
        names.append(K_SWEEP_PNG)
    return names


def _memory_section(results: dict, runs: list[Run]) -> list[str]:
    """Per method: what its drafter runs (kernels, where it says), the size of the drafter's own
    weights (where it reports it), and the process's peak resident memory during its runs."""
    drafters = (results.get("config") or {}).get("drafters") or {}
    peaks: dict[str, float] = {}
    for run in runs:
        if run.get("peak_rss_mib") is not None:
            peaks[run["label"]] = max(peaks.get(run["label"], 0.0), run["peak_rss_mib"])
    if not peaks and not drafters:
        return []
    rows = []
    for label in labels_in_order(runs):
        entry = drafters.get(label) or {}
        weights = entry.get("weights_mib")
        rows.append([_name(label), entry.get("runs") or "–",
                     "–" if weights is None else f"{weights:.0f}",
                     "–" if label not in peaks else f"{peaks[label]:.0f}"])
    return ["", "## Drafters and memory", "",
            "`weights`: the drafter's own weights in MiB (shared tensors, such as the target's "
            "embedding, not counted). `peak`: the process's most resident memory (MiB) during the "
            "method's runs; every method's weights are loaded at once, so it differs between "
            "methods only by their working memory.", ""
            ] + _table(["method", "drafter runs", "weights", "peak"], rows)


def render_markdown(results: dict, figures: list[str] | None = None) -> str:
    """A Spec-Bench-style Markdown report of a results dict.

    Sections: header (model, dtype, device, machine, settings, questions per task); speedup table
    (tasks and overall vs hf, overall vs ar, τ, tok/s, identical n/m) with a note on `ar` against
    the bare-forward limit; theory vs measurement; drafters and memory; exactness (every
    non-identical run, its first difference and logit gap); acceptance per draft position; links
    to the figures. `figures` are the PNG names to link (default: those `write_report` would
    draw). Summary and theory are recomputed from results["runs"].
    """
    runs = results.get("runs") or []
    summary = summarize(runs) if runs else (results.get("summary") or {})
    forward = results.get("forward") or {}
    config = results.get("config") or {}
    greedy = not config.get("temperature")
    lines = _header(results, runs)
    lines += [""] + _main_table(summary) if summary else ["", "No runs."]
    lines += _ar_note(summary, forward)
    lines += _tree_section(runs, summary)
    lines += _theory_section(theory(runs, forward))
    lines += _memory_section(results, runs)
    lines += _exactness_section(runs, greedy, config.get("dtype") or "float32")
    speculative = [lb for lb in labels_in_order(runs)
                   if is_speculative_method(next(r["method"] for r in runs if r["label"] == lb))]
    lines += _acceptance_section(runs, speculative)
    figures = expected_figures(runs, summary) if figures is None else figures
    if figures:
        lines += ["", "## Figures", ""] + [f"![{Path(f).stem.replace('_', ' ')}]({f})" for f in figures]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------------
# comparison


def _results_summary(results: dict) -> dict:
    runs = results.get("runs")
    return summarize(runs) if runs else (results.get("summary") or {})


def _change(a: float | None, b: float | None) -> str:
    return "–" if a is None or b is None or a == 0 else f"{100 * (b / a - 1):+.1f}%"


def compare(a: dict, b: dict, name_a: str = "A", name_b: str = "B") -> str:
    """Markdown comparing two results dicts: overall and per-task speedup vs hf, and τ, per label.

    Only labels present in both are tabulated; the others are listed. Differences in model, dtype,
    device, max_new_tokens or temperature, and in the set of questions, are noted first, since they
    make the numbers incomparable.
    """
    sa, sb = _results_summary(a), _results_summary(b)
    lines = [f"# Benchmark comparison: {name_a} → {name_b}", ""]
    ca, cb = a.get("config") or {}, b.get("config") or {}
    differ = [f"{key}: {ca.get(key)!r} vs {cb.get(key)!r}"
              for key in ("model", "dtype", "device", "max_new_tokens", "temperature")
              if ca.get(key) != cb.get(key)]
    if differ:
        lines.append("**Configurations differ** (" + "; ".join(differ) + "): the numbers may not be "
                     "comparable.")
    qa = {(r["task"], r["question_id"]) for r in a.get("runs") or []}
    qb = {(r["task"], r["question_id"]) for r in b.get("runs") or []}
    if qa and qb and qa != qb:
        lines.append(f"**Question sets differ**: {len(qa & qb)} in common, {len(qa - qb)} only in {name_a}, "
                     f"{len(qb - qa)} only in {name_b}.")
    only_a, only_b = [lb for lb in sa if lb not in sb], [lb for lb in sb if lb not in sa]
    if only_a:
        lines.append(f"Only in {name_a}: " + ", ".join(_name(lb) for lb in only_a) + ".")
    if only_b:
        lines.append(f"Only in {name_b}: " + ", ".join(_name(lb) for lb in only_b) + ".")
    if lines[-1]:
        lines.append("")

    both = [lb for lb in sa if lb in sb]
    if not both:
        return "\n".join(lines + ["No label appears in both results."]) + "\n"
    rows = []
    for lb in both:
        oa, ob = sa[lb][OVERALL], sb[lb][OVERALL]
        rows.append([_name(lb), _x(oa["speedup_vs_hf"]), _x(ob["speedup_vs_hf"]),
                     _change(oa["speedup_vs_hf"], ob["speedup_vs_hf"]),
                     _f(oa["mean_accepted_tokens"]), _f(ob["mean_accepted_tokens"])])
    lines += ["## Overall", ""] + _table(
        ["method", f"speedup vs hf ({name_a})", f"speedup vs hf ({name_b})", "change",
         f"τ ({name_a})", f"τ ({name_b})"], rows)

    tasks = [t for t in summary_tasks(sa) if t in summary_tasks(sb)]
    if tasks:
        rows = []
        for lb in both:
            row = [_name(lb)]
            for t in tasks:
                va = sa[lb].get(t, {}).get("speedup_vs_hf")
                vb = sb[lb].get(t, {}).get("speedup_vs_hf")
                row.append("–" if va is None or vb is None else f"{_x(va)} → {_x(vb)} ({_change(va, vb)})")
            rows.append(row)
        lines += ["", "## Speedup vs hf by task", ""] + _table(["method", *tasks], rows)
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------------------------------
# files


def write_report(results: dict, out_dir: Path) -> list[Path]:
    """Write report.md and the figures into out_dir (created if needed); return the paths written."""
    from verispec.bench import plots  # matplotlib is loaded only when figures are drawn

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    runs = results.get("runs") or []
    summary = summarize(runs) if runs else (results.get("summary") or {})
    config = results.get("config") or {}
    subtitle = " · ".join(str(config[k]) for k in ("model", "dtype", "device") if config.get(k))
    drawn = [
        plots.plot_speedup_by_task(summary, out_dir / SPEEDUP_PNG, subtitle=subtitle, runs=runs or None),
        plots.plot_acceptance_by_position(runs, out_dir / ACCEPTANCE_PNG, subtitle=subtitle),
        plots.plot_k_sweep(summary, runs, out_dir / K_SWEEP_PNG, subtitle=subtitle),
    ]
    figures = [p for p in drawn if p is not None]
    report = out_dir / REPORT_FILE
    report.write_text(render_markdown(results, figures=[p.name for p in figures]), encoding="utf-8")
    return [report, *figures]
