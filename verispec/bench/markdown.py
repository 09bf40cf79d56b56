"""Markdown from bench results: the Spec-Bench-style report, and the comparison of two results."""

from __future__ import annotations

import statistics
from collections import defaultdict
from pathlib import Path

from verispec.bench.records import (
    AR,
    HF,
    MethodSummary,
    Results,
    Run,
    SpeedupModel,
    display_label,
    tasks_in_order,
)
from verispec.bench.summary import (
    TIE_ABSOLUTE,
    TIE_ULPS,
    acceptance_curves,
    by_label,
    differing_runs,
    labels_in_order,
    pooled_stats,
    speedup_model,
    summarize,
    summary_tasks,
    tree_sweep,
    verdict,
)
from verispec.decoding.beam import BeamSettings
from verispec.display import chosen

DISAGREEMENT = 0.20  # theory vs measurement flagged beyond this relative difference


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


def _header(results: Results) -> list[str]:
    config, machine = results.config, results.machine
    temperature = config.get("temperature")
    mode = "greedy" if not temperature else "sampling"
    questions: dict[str, set] = defaultdict(set)
    for run in results.runs:
        questions[run.task].add(run.question_id)
    per_task = ", ".join(f"{t} {len(questions[t])}" for t in tasks_in_order(questions))
    lines = [
        "# verispec benchmark",
        "",
        f"- **model**: {config.get('model', '?')} · **dtype**: {config.get('dtype', '?')}"
        f" · **kernel**: {config.get('kernel', '?')} · **device**: {config.get('device', '?')}"
        f" · **invariance**: {config.get('invariance', '?')} · **forward**: {config.get('path', '?')}",
        f"- **max_new_tokens**: {config.get('max_new_tokens', '?')} · **temperature**: {temperature}"
        f" ({mode}) · **seed**: {config.get('seed', '?')} · **warmup**: {config.get('warmup', '?')}"
        + (f" · **repeats**: {config['repeats']} (each run's seconds: the median of them)"
           if (config.get("repeats") or 1) > 1 else ""),
        f"- **questions per task**: {per_task or 'none'}"
        f" ({sum(len(q) for q in questions.values())} in total)",
    ]
    if beams := results.beams:
        lines.append(f"- **beam search**: B = {beams.num_beams} (num_beams) · **length_penalty**: "
                     f"{beams.length_penalty} · **early_stopping**: {beams.early_stopping}")
    if left_out := config.get("left_out"):
        lines.append("- **left out**: "
                     + "; ".join(f"`{name}`: {why}" for name, why in left_out.items()))
    if crashed := config.get("crashed"):
        lines.append("- **crashed** (a peer's child process died; its runs before and the others stand): "
                     + "; ".join(f"`{name}` {why}" for name, why in crashed.items()))
    if config.get("crowded"):
        lines.append(f"- **busy machine**: other processes kept {config['others_busy_cores']} of "
                     f"{config['cores']:g} cores busy on average during the timed runs: these timings are "
                     "not this machine's alone; run again on an idle machine")
    if machine:
        lines.append("- **machine**: " + ", ".join(f"{k}: {v}" for k, v in machine.items()))
    return lines


def spread(runs: list[Run], label: str) -> float | None:
    """With --repeats: how far `label`'s summed seconds moved between rounds, (most - least) /
    median over the rounds (round r: every question's r-th run); None without repeats."""
    rounds = [run.repeat_seconds for run in runs if run.label == label]
    if not rounds or min(len(r) for r in rounds) < 2:
        return None
    totals = sorted(sum(r[i] for r in rounds) for i in range(min(len(r) for r in rounds)))
    return (totals[-1] - totals[0]) / statistics.median(totals)


def _spread(value: float | None) -> str:
    return "–" if value is None else f"{100 * value:.1f}%"


def _main_table(summaries: list[MethodSummary], crashed: dict[str, str], runs: list[Run]) -> list[str]:
    tasks = summary_tasks(summaries)
    if any(s.label == HF for s in summaries):
        key, title = "speedup_vs_hf", "## Speedup over Hugging Face generate()"
        intro = ("Task and overall columns: speedup vs `hf` (Hugging Face `generate()`), the ratio of summed "
                 "wall-clock seconds over the questions both ran (Spec-Bench's convention). `vs ar`: the "
                 "same against verispec's plain decoding.")
    else:
        key, title = "speedup_vs_ar", "## Speedup over plain decoding"
        intro = ("No `hf` runs: task and overall columns show the speedup vs `ar` (verispec's plain "
                 "decoding), the ratio of summed wall-clock seconds over the questions both ran.")
    spreads = {s.label: spread(runs, s.label) for s in summaries}
    repeated = any(value is not None for value in spreads.values())
    header = ["method", *tasks, "overall", "vs ar", "τ", "tok/s", "identical"]
    header += ["spread"] if repeated else []
    rows = []
    for s in summaries:
        overall = s.overall
        name = _name(s.label) + (f" — {crashed[s.label]}" if s.label in crashed else "")
        rows.append([name,
                     *[_x(getattr(s.cells[t], key)) if t in s.cells else "–" for t in tasks],
                     f"**{_x(getattr(overall, key))}**", _x(overall.speedup_vs_ar),
                     _f(overall.mean_accepted_tokens), _f(overall.tokens_per_second, 1),
                     overall.identical]
                    + ([_spread(spreads[s.label])] if repeated else []))
    ran = {s.label for s in summaries}
    rows += [[f"{_name(label)} — {why}", *["–"] * (len(header) - 1)]
             for label, why in crashed.items() if label not in ran]
    intro += (" τ: new tokens per target forward. tok/s: new tokens per second over all the method's runs. "
              "`identical`: runs whose output equals `ar`'s token for token.")
    if repeated:
        intro += (" Each run's seconds are the median of the repeats; `spread`: how far the method's "
                  "summed seconds moved between rounds ((most - least) / median): a speedup between "
                  "two methods closer than their spreads is not a difference.")
    return [title, "", intro, ""] + _table(header, rows)


def _beam_table(summaries: list[MethodSummary], beams: BeamSettings) -> list[str]:
    """Beam search's table: speed against Hugging Face's and verispec's plain beam search, search
    steps per target pass, and best sequences identical to Hugging Face's."""
    tasks = summary_tasks(summaries)
    b = beams.num_beams
    header = ["method", *tasks, "overall", "vs ar", "steps/pass", "seconds", "tok/s", "= hf"]
    rows = [[_name(s.label), *[_x(s.cells[t].speedup_vs_hf) if t in s.cells else "–" for t in tasks],
             f"**{_x(s.overall.speedup_vs_hf)}**", _x(s.overall.speedup_vs_ar),
             _f(s.overall.search_steps_per_pass), _f(s.overall.seconds, 1),
             _f(s.overall.tokens_per_second, 1), s.overall.identical] for s in summaries]
    intro = (f"Every contender runs beam search with B = {b} beams and returns its best sequence: `hf` is "
             f"Hugging Face `generate(num_beams={b})`, `ar` verispec's plain beam search, the others "
             "verispec's speculative beam search (each beam drafts; one target pass scores every "
             "beam's draft; verispec.decoding.beam). Task and overall columns: speedup vs `hf`, the ratio of "
             "summed wall-clock seconds over the questions both ran. `vs ar`: the same against "
             "verispec's plain beam search. steps/pass: search steps per target forward (1 for plain "
             "beam search). tok/s: tokens of the best sequence per second. `= hf`: questions whose "
             "best sequence equals Hugging Face's, token for token.")
    return [f"## Beam search (B = {b}): speedup over Hugging Face generate(num_beams={b})", "", intro,
            ""] + _table(header, rows)


def _ar_note(summaries: list[MethodSummary], results: Results) -> list[str]:
    forward = results.forward
    ar = next((s for s in summaries if s.label == AR), None)
    bare = forward.bare_forward_seconds if forward else None
    if ar is None or not bare:
        return []
    ar_tps = ar.overall.tokens_per_second
    limit = 1.0 / bare
    if ar_tps <= 0:
        return []
    overhead_ms = (1.0 / ar_tps - bare) * 1000
    return ["", f"`ar` runs at {ar_tps:.1f} tok/s against a bare-forward limit of {limit:.1f} tok/s "
            f"(1 / {bare * 1000:.1f} ms, one one-token forward with a cache, timed alone): "
            f"{100 * (1 - ar_tps / limit):.0f}% below it, about {overhead_ms:.1f} ms per token beyond the "
            "forward. That gap is the engine's per-step overhead (prefill time is included in `ar`'s "
            "seconds, so part of it is the prompt)."] + _verify_cost_note(results)


def _verify_cost_note(results: Results) -> list[str]:
    """One line: what scoring n tokens in one forward costs, in one-token forwards."""
    forward = results.forward
    by_tokens = {int(n): t for n, t in forward.by_tokens.items()}
    one = by_tokens.get(1)
    if not one or len(by_tokens) < 2:
        return []
    costs = ", ".join(f"{n}: {t / one:.2f}×" for n, t in sorted(by_tokens.items()) if n > 1)
    lines = ["", f"Verification cost on this machine: one forward over n new tokens costs, in one-token "
             f"forwards, {costs}. Speculation pays only when the tokens a step gains outweigh this."]
    unpacked = {int(n): t for n, t in (forward.unpacked_by_tokens or {}).items()}
    if unpacked.get(1):
        costs = ", ".join(f"{n}: {t / unpacked[1]:.2f}×" for n, t in sorted(unpacked.items()) if n > 1)
        how = ("through verispec.model.lean (fused prepacked weights, a preallocated KV cache)"
               if forward.lean else "with prepacked linear weights (verispec.model.packed)")
        lines += ["", f"The engine runs the target {how}. "
                  f"Through the model's own linear layers, as Hugging Face generate() runs it, one "
                  f"token takes {unpacked[1] * 1000:.1f} ms (prepacked: {one * 1000:.1f} ms) and n "
                  f"tokens cost {costs}."]
    return lines


def _theory_section(models: dict[str, SpeedupModel]) -> list[str]:
    if not models:
        return []
    rows, disagree, mean_k = [], [], []
    trees = [_name(label) for label, m in models.items() if m.tree]
    for label, m in models.items():
        k_text = "–" if m.k is None else f"{m.k:.1f}*" if m.k_is_mean_drafted_length else str(m.k)
        if m.tree:
            k_text = f"{k_text} (tree {m.tree})"
        if m.k_is_mean_drafted_length and m.k is not None:
            mean_k.append(label)
        best = "–" if m.best_k is None else f"{m.best_k} ({_x(m.best_k_predicted_speedup)})"
        best_cost = ("–" if m.best_k_with_verify_cost is None else
                     f"{m.best_k_with_verify_cost} ({_x(m.best_k_with_verify_cost_predicted_speedup)})")
        rows.append([_name(label), _f(m.alpha), _f(m.c, 3), k_text, _x(m.predicted_speedup),
                     _x(m.predicted_speedup_with_verify_cost), _x(m.measured_speedup_vs_ar),
                     best, best_cost])
        predicted = m.predicted_speedup_with_verify_cost or m.predicted_speedup
        measured = m.measured_speedup_vs_ar
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


def _exactness_section(runs: list[Run], greedy: bool, dtype: str, reference: str) -> list[str]:
    lines = ["", "## Exactness", ""]
    checked = [r for r in runs if r.identical_to_baseline is not None and not r.peer]
    failed = differing_runs(runs)
    lines += _peer_agreement(runs)
    if not checked:
        reason = ("no comparison was recorded" if greedy else
                  "under sampling only the output distribution is exact, not the tokens")
        return lines + [f"No run was compared with `{reference}` token for token ({reason})."]
    if not failed:
        return lines + [f"All {len(checked)} compared runs are identical to `{reference}`, token for token."]
    lossy = sum(r.lossy for r in failed)
    if any(r.beam_search for r in failed):
        why = ("Beam search keeps beams by summed log-probs, so no single logit gap tells a tie: "
               "compare the two sequences' scores (verispec.generate(num_beams=B) gives them).")
    else:
        why = (f"A logit gap at the first difference of at most {TIE_ABSOLUTE}, or {TIE_ULPS} units in "
               f"the last place of the logit in {dtype} when that is larger, means the two tokens were "
               "tied up to rounding (a batched verify pass rounds differently from one-token "
               "decoding); a larger gap points to a bug.")
    lines += [f"{len(failed)} of {len(checked)} compared runs differ from `{reference}`"
              + (f" ({lossy} of them from lossy methods, expected)" if lossy else "") + ". " + why, ""]
    rows = []
    for r in failed:
        diff = r.first_difference
        where = ["–"] * 4 if diff is None else [
            str(diff.position), str(diff.ours), str(diff.baseline),
            "–" if diff.logit_gap is None else f"{diff.logit_gap:.3g}"]
        rows.append([_name(r.label), r.task, str(r.question_id), *where, verdict(r, dtype)])
    return lines + _table(["method", "task", "question", "position", "ours", "baseline", "logit gap",
                           "verdict"], rows)


def _peer_agreement(runs: list[Run]) -> list[str]:
    """Other engines' agreement with `ar` (their arithmetic is their own: reported, not required)."""
    lines = []
    for label in labels_in_order([r for r in runs if r.peer and r.identical_to_baseline is not None]):
        mine = [r for r in runs if r.label == label and r.identical_to_baseline is not None]
        positions = sorted(r.first_difference.position for r in mine
                           if not r.identical_to_baseline and r.first_difference is not None)
        where = f"; where they part, at token {', '.join(map(str, positions))}" if positions else ""
        lines.append(f"- `{label}` agrees with `ar` on {sum(r.identical_to_baseline for r in mine)} of "
                     f"{len(mine)} outputs token for token{where} (its own kernels and reductions: "
                     "agreement is reported, not required).")
    return [*lines, ""] if lines else []


def _acceptance_section(runs: list[Run]) -> list[str]:
    curves = acceptance_curves(runs)
    if not curves:
        return []
    width = max(len(rates) for rates, _ in curves.values())
    rows = [[_name(label), str(reached[0]), *[_pct(rates[i]) if i < len(rates) else "–"
                                               for i in range(width)]]
            for label, (rates, reached) in curves.items()]
    intro = ("Chance that draft position i is accepted, given that it was drafted and every earlier "
             "position was accepted, pooled over all questions. `steps`: drafting steps (the sample size "
             "at position 1; later positions are reached less often, so their rates are noisier).")
    header = ["method", "steps", *[str(i + 1) for i in range(width)]]
    return ["", "## Acceptance by draft position", "", intro, ""] + _table(header, rows)


def _choices_section(runs: list[Run]) -> list[str]:
    """What a choosing drafter (`auto`) drafted with, per label, over all its runs."""
    grouped = by_label(runs)
    rows = [[_name(label), chosen(stats)] for label in labels_in_order(runs)
            if (stats := pooled_stats(grouped[label])).choices]
    if not rows:
        return []
    intro = ("New tokens per method a choosing drafter drafted with (plain decoding: `ar`) over all "
             "questions (each question's run of median seconds), and its stretches: a new one wherever "
             "the method changed.")
    return ["", "## What `auto` chose", "", intro, ""] + _table(["method", "chose"], rows)


def _boundary_section(runs: list[Run]) -> list[str]:
    """What crossed the tokenizer boundary, per label whose draft model has another tokenizer."""
    grouped = by_label(runs)
    rows = []
    for label in labels_in_order(runs):
        stats = pooled_stats(grouped[label])
        if stats.foreign_tokens:
            rows.append([_name(label), str(stats.foreign_tokens), str(stats.boundary_lost),
                         _pct(stats.boundary_lost_share)])
    if not rows:
        return []
    intro = ("A draft model with another tokenizer than the target's drafts in its own tokens; its text "
             "goes into the target's tokens, and what it drafted past the last whole target token (a "
             "word it had not finished, the token that showed the one before was whole) is lost at the "
             "boundary (docs/cross-tokenizer.md).")
    return (["", "## Drafting across tokenizers", "", intro, ""]
            + _table(["method", "draft-model tokens", "lost at the boundary", "share"], rows))


def _tree_section(runs: list[Run], summaries: list[MethodSummary]) -> list[str]:
    sweep = tree_sweep(runs, summaries)
    if not sweep:
        return []
    lines = ["", "## Trees against chains", "",
             "Each tree-capable method's chain beside its trees (TOPKxNODES, depth = K). A bigger "
             "tree adds τ but makes every verification forward longer (more rows scored); "
             "`vs chain` shows where that stops paying on this machine.", ""]
    rows = [[_name(p.label), "chain" if p.tree is None else p.tree, str(p.nodes), _f(p.tau),
             _x(p.speedup_vs_ar), _x(p.vs_chain)] for points in sweep.values() for p in points]
    return lines + _table(["method", "shape", "draft nodes (max)", "τ", "vs ar", "vs chain"], rows)


def _memory_section(results: Results) -> list[str]:
    """Per method: what its drafter runs (kernels, where it says), the size of the drafter's own
    weights (where it reports it), and the process's peak resident memory during its runs."""
    drafters = results.config.get("drafters") or {}
    peaks: dict[str, float] = {}
    for run in results.runs:
        if run.peak_rss_mib is not None:
            peaks[run.label] = max(peaks.get(run.label, 0.0), run.peak_rss_mib)
    if not peaks and not drafters:
        return []
    rows = []
    for s in summarize(results.runs):
        entry = drafters.get(s.label) or {}
        weights = entry.get("weights_mib")
        rows.append([_name(s.label), entry.get("runs") or "–",
                     "–" if weights is None else f"{weights:.0f}",
                     "–" if s.label not in peaks else f"{peaks[s.label]:.0f}"])
    return ["", "## Drafters and memory", "",
            "`weights`: the drafter's own weights in MiB (shared tensors, such as the target's "
            "embedding, not counted). `peak`: the process's most resident memory (MiB) during the "
            "method's runs; every method's weights are loaded at once, so it differs between "
            "methods only by their working memory. A baseline's is its own child process's (its "
            "own copy of what it runs).", ""
            ] + _table(["method", "drafter runs", "weights", "peak"], rows)


def render_markdown(results: Results, figures: list[str] = ()) -> str:
    """A Spec-Bench-style Markdown report of `results`, linking the PNG files `figures`.

    Sections: header (model, dtype, device, machine, settings, questions per task, beam search's
    B); speedup table (tasks and overall vs hf, overall vs ar, τ, tok/s, identical n/m) with a
    note on `ar` against the bare-forward limit, or under beam search its own table (vs hf and
    ar, search steps per pass, seconds, tok/s, best sequences identical to hf's); trees against
    chains; theory vs measurement; drafters and memory; exactness (every non-identical run, its
    first difference and logit gap); acceptance per draft position; what `auto` chose; what a draft model with
    another tokenizer lost at the boundary; the figures.
    """
    runs = results.runs
    summaries = summarize(runs)
    greedy = not results.config.get("temperature")
    lines = _header(results)
    beams = results.beams
    if not summaries:
        lines += ["", "No runs."]
    elif beams is not None:  # B rows a step: the one-path notes on ar and verification do not apply
        lines += [""] + _beam_table(summaries, beams)
    else:
        crashed = results.config.get("crashed") or {}
        lines += [""] + _main_table(summaries, crashed, runs) + _ar_note(summaries, results)
    lines += _tree_section(runs, summaries)
    lines += _theory_section(speedup_model(runs, results.forward))
    lines += _memory_section(results)
    lines += _exactness_section(runs, greedy, results.config.get("dtype") or "float32", results.reference)
    lines += _acceptance_section(runs)
    lines += _choices_section(runs)
    lines += _boundary_section(runs)
    if figures:
        lines += ["", "## Figures", ""] + [f"![{Path(f).stem.replace('_', ' ')}]({f})" for f in figures]
    return "\n".join(lines) + "\n"


def _change(a: float | None, b: float | None) -> str:
    return "–" if a is None or b is None or a == 0 else f"{100 * (b / a - 1):+.1f}%"


def compare(a: Results, b: Results, name_a: str = "A", name_b: str = "B") -> str:
    """Markdown comparing two results: overall and per-task speedup vs hf, and τ, per label.

    Only labels present in both are tabulated; the others are listed. Differences in model, dtype,
    device, max_new_tokens, temperature or beam search, and in the set of questions, are noted
    first, since they make the numbers incomparable.
    """
    sa = {s.label: s for s in summarize(a.runs)}
    sb = {s.label: s for s in summarize(b.runs)}
    lines = [f"# Benchmark comparison: {name_a} → {name_b}", ""]
    differ = [f"{key}: {a.config.get(key)!r} vs {b.config.get(key)!r}"
              for key in ("model", "dtype", "device", "max_new_tokens", "temperature", "beams")
              if a.config.get(key) != b.config.get(key)]
    if differ:
        lines.append("**Configurations differ** (" + "; ".join(differ) + "): the numbers may not be "
                     "comparable.")
    qa = {(r.task, r.question_id) for r in a.runs}
    qb = {(r.task, r.question_id) for r in b.runs}
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
        oa, ob = sa[lb].overall, sb[lb].overall
        rows.append([_name(lb), _x(oa.speedup_vs_hf), _x(ob.speedup_vs_hf),
                     _change(oa.speedup_vs_hf, ob.speedup_vs_hf),
                     _f(oa.mean_accepted_tokens), _f(ob.mean_accepted_tokens)])
    lines += ["## Overall", ""] + _table(
        ["method", f"speedup vs hf ({name_a})", f"speedup vs hf ({name_b})", "change",
         f"τ ({name_a})", f"τ ({name_b})"], rows)

    tasks = [t for t in summary_tasks(sa.values()) if t in summary_tasks(sb.values())]
    if tasks:
        rows = []
        for lb in both:
            row = [_name(lb)]
            for t in tasks:
                va = sa[lb].cells[t].speedup_vs_hf if t in sa[lb].cells else None
                vb = sb[lb].cells[t].speedup_vs_hf if t in sb[lb].cells else None
                row.append("–" if va is None or vb is None else f"{_x(va)} → {_x(vb)} ({_change(va, vb)})")
            rows.append(row)
        lines += ["", "## Speedup vs hf by task", ""] + _table(["method", *tasks], rows)
    return "\n".join(lines) + "\n"
