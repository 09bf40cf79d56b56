"""Benchmark reporting on synthetic run records: exact ratios, theory formula, Markdown, PNG files."""

from __future__ import annotations

import doctest
import json
from dataclasses import replace

import pytest

from verispec.bench import plots, summary
from verispec.bench.markdown import compare, render_markdown
from verispec.bench.records import FirstDifference, ForwardTimings, Results, Run
from verispec.bench.report import figure_data, results_json, write_report
from verispec.bench.summary import (
    acceptance_by_position,
    leviathan_speedup,
    looks_like_tie,
    verify_cost_ratio,
)
from verispec.profile import cpu_description

QUESTIONS = {0: "mt_bench", 1: "mt_bench", 2: "qa", 3: "qa"}
HF_SECONDS = {0: 10.0, 1: 20.0, 2: 10.0, 3: 10.0}
AR_SECONDS = {0: 8.0, 1: 8.0, 2: 8.0, 3: 8.0}  # 32 s for 400 tokens: 0.08 s per token
PLD4_SECONDS = {0: 5.0, 1: 4.0, 2: 6.0, 3: 2.0}
PLD8_SECONDS = {0: 4.0, 1: 4.0, 2: 4.0, 3: 4.0, 4: 100.0}  # question 4: not run by hf or ar
BY_TOKENS = {"1": 0.06, "2": 0.08, "4": 0.09, "8": 0.10, "16": 0.12}


def run(label: str, method: str, qid: int, seconds: float, k: int | None = None, forwards: int | None = 100,
        drafted: list[int] = (), accepted: list[int] = (), reached: list[int] = (),
        draft_seconds: float | None = None, identical: bool | None = None,
        diff: FirstDifference | None = None) -> Run:
    return Run(method=method, label=label, task=QUESTIONS.get(qid, "qa"), question_id=qid, k=k,
               new_tokens=100, seconds=seconds, target_forwards=forwards,
               baseline=method in ("hf", "ar"), drafted_by_position=tuple(drafted),
               accepted_by_position=tuple(accepted), reached_by_position=tuple(reached),
               draft_seconds=draft_seconds,
               verify_seconds=None if draft_seconds is None else seconds - draft_seconds,
               identical_to_baseline=identical, first_difference=diff)


def summarize(runs: list[Run]) -> dict:
    """label -> task -> cell, as results.json holds the summary."""
    return results_json(Results(runs=runs))["summary"]


def synthetic_runs() -> list[Run]:
    """hf, ar, pld k=4 (alpha 0.5, c 0) and pld k=8 (c 0.05, two non-identical runs)."""
    runs = [run("hf", "hf", q, s, forwards=None) for q, s in HF_SECONDS.items()]
    runs += [run("ar", "ar", q, s) for q, s in AR_SECONDS.items()]
    runs += [run("pld k=4", "pld", q, s, k=4, forwards=50, drafted=[40, 40, 40, 40], accepted=[20, 10, 5, 3],
                 reached=[40, 20, 10, 6], draft_seconds=0.0, identical=True) for q, s in PLD4_SECONDS.items()]
    diffs = {1: FirstDifference(position=17, ours=5, baseline=9, logit_gap=0.004),
             3: FirstDifference(position=40, ours=7, baseline=8, logit_gap=2.5)}
    runs += [run("pld k=8", "pld", q, s, k=8, forwards=40, drafted=[20] * 8,
                 accepted=[16, 12, 8, 4, 2, 1, 0, 0], reached=[20, 16, 12, 8, 4, 2, 1, 0],
                 draft_seconds=0.64, identical=q not in diffs, diff=diffs.get(q))
             for q, s in PLD8_SECONDS.items()]
    return runs


def synthetic_results(runs: list[Run] | None = None) -> Results:
    runs = synthetic_runs() if runs is None else runs
    config = {"model": "tiny", "dtype": "float32", "device": "cpu", "methods": ["hf", "ar", "pld"],
              "ks": [4, 8], "max_new_tokens": 100, "temperature": 0.0, "seed": 0, "questions": None,
              "tasks": ["mt_bench", "qa"], "limit_per_task": 2, "warmup": 1}
    return Results(config, {"cpu": "test", "cores": 2}, ForwardTimings(dict(BY_TOKENS)), list(runs))


def theory(runs: list[Run], forward: ForwardTimings | None) -> dict:
    """label -> speedup model, as results.json holds it."""
    return results_json(Results(forward=forward, runs=runs))["theory"]


def test_docstring_examples():
    assert doctest.testmod(summary).failed == 0


def test_summarize_is_a_ratio_of_sums_over_common_questions():
    s = summarize(synthetic_runs())
    assert list(s) == ["hf", "ar", "pld k=4", "pld k=8"]
    assert list(s["pld k=4"]) == ["mt_bench", "qa", "overall"]
    pld4 = s["pld k=4"]
    assert pld4["mt_bench"]["speedup_vs_hf"] == pytest.approx(30 / 9)  # not the mean of ratios, 3.5
    assert pld4["qa"]["speedup_vs_hf"] == pytest.approx(20 / 8)
    assert pld4["overall"]["speedup_vs_hf"] == pytest.approx(50 / 17)
    assert pld4["overall"]["speedup_vs_ar"] == pytest.approx(32 / 17)
    assert pld4["overall"]["mean_accepted_tokens"] == pytest.approx(2.0)
    assert pld4["overall"]["tokens_per_second"] == pytest.approx(400 / 17)
    # question 4 has no baseline: left out of speedups, kept in tokens/s
    pld8 = s["pld k=8"]["overall"]
    assert pld8["speedup_vs_hf"] == pytest.approx(50 / 16)
    assert pld8["speedup_vs_ar"] == pytest.approx(32 / 16)
    assert pld8["tokens_per_second"] == pytest.approx(500 / 116)
    assert s["hf"]["overall"]["speedup_vs_hf"] == pytest.approx(1.0)
    assert s["ar"]["overall"]["speedup_vs_hf"] == pytest.approx(50 / 32)


def test_summarize_identical_counts_tau_and_missing_baselines():
    s = summarize(synthetic_runs())
    assert s["pld k=8"]["overall"]["identical"] == "3/5"
    assert s["pld k=8"]["mt_bench"]["identical"] == "1/2"
    assert s["pld k=4"]["overall"]["identical"] == "4/4"
    assert s["ar"]["overall"]["identical"] == "-"
    assert s["hf"]["overall"]["mean_accepted_tokens"] is None  # forwards not measurable
    assert s["ar"]["overall"]["mean_accepted_tokens"] == pytest.approx(1.0)

    no_hf = summarize([r for r in synthetic_runs() if r.label != "hf"])
    assert no_hf["pld k=4"]["overall"]["speedup_vs_hf"] is None
    assert no_hf["pld k=4"]["overall"]["speedup_vs_ar"] == pytest.approx(32 / 17)


def test_leviathan_formula_hand_computed():
    assert leviathan_speedup(0.5, 4, 0.0) == pytest.approx(1.9375)  # (1 - 1/32) / 0.5
    assert leviathan_speedup(1.0, 4, 0.25) == pytest.approx(5 / 2)  # alpha = 1: limit K + 1
    assert leviathan_speedup(0.5, 1, 1.0, verify_cost=2.0) == pytest.approx(0.75 / 1.5)


def test_verify_cost_ratio_interpolates_and_extends():
    assert verify_cost_ratio(BY_TOKENS, 1) == pytest.approx(1.0)
    assert verify_cost_ratio(BY_TOKENS, 5) == pytest.approx(0.0925 / 0.06)
    assert verify_cost_ratio(BY_TOKENS, 24) == pytest.approx(0.14 / 0.06)  # last segment extended
    assert verify_cost_ratio({}, 5) is None


def test_theory_on_a_hand_computed_case():
    results = synthetic_results()
    t = theory(results.runs, results.forward)
    assert list(t) == ["pld k=4", "pld k=8"]
    pld4 = t["pld k=4"]
    assert pld4["alpha"] == pytest.approx(0.5)
    assert pld4["c"] == pytest.approx(0.0)
    assert pld4["k"] == 4 and not pld4["k_is_mean_drafted_length"]
    assert pld4["predicted_speedup"] == pytest.approx(1.9375)
    assert pld4["predicted_speedup_with_verify_cost"] == pytest.approx(1.9375 / (0.0925 / 0.06))
    assert pld4["measured_speedup_vs_ar"] == pytest.approx(32 / 17)
    assert pld4["best_k"] == 32  # free drafting: longer is always better in the paper's model
    assert pld4["best_k_predicted_speedup"] == pytest.approx(leviathan_speedup(0.5, 32, 0.0))
    assert pld4["best_k_with_verify_cost"] < 32  # verification is not free on a CPU

    pld8 = t["pld k=8"]
    assert pld8["alpha"] == pytest.approx(43 / 63)
    assert pld8["c"] == pytest.approx((5 * 0.64 / 800) / 0.08)  # 0.004 s per drafted token / 0.08
    assert pld8["predicted_speedup"] == pytest.approx(leviathan_speedup(43 / 63, 8, 0.05))


def test_theory_best_k_mean_k_and_missing_ar():
    # alpha 0.5 with costly drafts (c = 1): K = 1 is best
    runs = [run("ar", "ar", 0, 10.0),  # 0.1 s per token
            run("draft", "draft", 0, 5.0, k=2, drafted=[10, 10], accepted=[5, 2], reached=[10, 4],
                draft_seconds=2.0),
            run("draft", "draft", 1, 5.0, k=4, drafted=[10, 10, 10, 10], accepted=[5, 3, 1, 0],
                reached=[10, 6, 2, 0], draft_seconds=4.0)]
    t = theory(runs, None)["draft"]
    assert t["k_is_mean_drafted_length"] and t["k"] == pytest.approx(60 / 20)
    assert t["c"] == pytest.approx((6.0 / 60) / 0.1)
    assert t["alpha"] == pytest.approx(16 / 32)
    assert t["best_k"] == 1
    assert t["predicted_speedup_with_verify_cost"] is None  # no forward timings
    assert theory([r for r in runs if r.label != "ar"], {})["draft"]["c"] is None


def test_acceptance_by_position_is_conditional_and_pooled():
    runs = synthetic_runs()
    assert acceptance_by_position(runs, "pld k=4") == pytest.approx([0.5, 0.5, 0.5, 0.5])
    assert acceptance_by_position(runs, "pld k=8") == pytest.approx([0.8, 0.75, 2 / 3, 0.5, 0.5, 0.5, 0.0])
    assert acceptance_by_position(runs, "ar") == []


def test_render_markdown_tables_and_exactness():
    md = render_markdown(synthetic_results(), list(figure_data(synthetic_results())))
    assert "tiny" in md and "float32" in md and "mt_bench 2, qa 3" in md
    assert "| pld k=4 | 3.33× | 2.50× | **2.94×** | 1.88× | 2.00 | 23.5 | 4/4 |" in md
    assert "| ar |" in md and "| hf |" in md
    assert "16.7 tok/s" in md and "12.5 tok/s" in md and "25% below" in md  # bare-forward limit
    assert "2: 1.33×, 4: 1.50×, 8: 1.67×, 16: 2.00×" in md  # verification cost, from BY_TOKENS
    assert "prepacked" not in md  # no unpacked timings in these results: no comparison line
    results = synthetic_results()
    results.forward = replace(results.forward, unpacked_by_tokens={"1": 0.08, "8": 0.16})
    assert ("one token takes 80.0 ms (prepacked: 60.0 ms) and n tokens cost 8: 2.00×"
            in render_markdown(results))
    assert "verispec.model.packed" in render_markdown(results)
    results.forward = replace(results.forward, lean=True)
    assert "through verispec.model.lean" in render_markdown(results)
    assert "## Theory" in md and "1.94×" in md
    assert "| pld k=8 | mt_bench | 1 | 17 | 5 | 9 | 0.004 | likely a numerical tie |" in md
    assert "| pld k=8 | qa | 3 | 40 | 7 | 8 | 2.5 | **not a tie: investigate** |" in md
    assert "## Acceptance by draft position" in md and "| pld k=4 | 160 | 50% | 50% | 50% | 50% |" in md
    assert "(speedup_by_task.png)" in md and "(k_sweep.png)" in md


def test_tie_limit_follows_the_dtype_of_the_run():
    # A bfloat16 logit near 17 moves in steps of 0.125: one step apart is a rounding tie there,
    # a bug in float32; a gap of many steps is never a tie.
    def gap(logit_gap: float | None, baseline_logit: float | None = None) -> FirstDifference:
        return FirstDifference(3, 1, 2, logit_gap, baseline_logit)

    one_step = gap(0.125, 17.0)
    assert looks_like_tie(one_step, "bfloat16") is True
    assert looks_like_tie(one_step, "float32") is False
    assert looks_like_tie(gap(1.0, 17.0), "bfloat16") is False
    assert looks_like_tie(gap(0.004, 17.0), "float32") is True
    assert looks_like_tie(gap(0.125), "bfloat16") is False  # no logit: float32 limit
    assert looks_like_tie(gap(None)) is None


def test_render_markdown_marks_typical_as_lossy_everywhere():
    runs = synthetic_runs() + [
        run("medusa-typical k=4", "medusa-typical", q, 3.0, k=4, forwards=40, drafted=[10] * 4,
            accepted=[8, 6, 4, 2], reached=[10, 8, 6, 4], draft_seconds=0.1) for q in QUESTIONS]
    md = render_markdown(synthetic_results(runs))
    assert md.count("medusa-typical k=4") >= 3  # main, theory and acceptance tables
    assert md.count("medusa-typical k=4") == md.count("medusa-typical k=4 (lossy)")


def test_render_markdown_all_identical_and_sampling():
    runs = [r for r in synthetic_runs() if r.label != "pld k=8"]
    assert "All 4 compared runs are identical" in render_markdown(synthetic_results(runs))
    sampled = synthetic_results([replace(r, identical_to_baseline=None) for r in runs])
    sampled.config["temperature"] = 0.7
    assert "only the output distribution is exact" in render_markdown(sampled)


def test_write_report_writes_markdown_and_pngs(tmp_path):
    paths = write_report(synthetic_results(), tmp_path / "out")
    names = [p.name for p in paths]
    assert names == ["report.md", "speedup_by_task.png", "acceptance_by_position.png", "k_sweep.png"]
    for path in paths:
        assert path.exists() and path.stat().st_size > 0
    for path in paths[1:]:
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "(acceptance_by_position.png)" in paths[0].read_text()


def test_k_sweep_skipped_with_one_k_per_method(tmp_path):
    runs = [r for r in synthetic_runs() if r.label != "pld k=8"]
    assert set(figure_data(synthetic_results(runs))) == {"speedup_by_task.png", "acceptance_by_position.png"}
    paths = write_report(synthetic_results(runs), tmp_path)
    assert "k_sweep.png" not in [p.name for p in paths]
    assert "k_sweep.png" not in paths[0].read_text()


def test_compare_shows_changes_and_differences():
    a = synthetic_results()
    b = synthetic_results([replace(r, seconds=r.seconds / 2) if r.label == "pld k=4" else r
                           for r in a.runs if r.label != "pld k=8"])
    b.config["temperature"] = 0.7
    text = compare(a, b)
    assert "| pld k=4 | 2.94× | 5.88× | +100.0% | 2.00 | 2.00 |" in text
    assert "| ar | 1.56× | 1.56× | +0.0% |" in text
    assert "Only in A: pld k=8" in text
    assert "Configurations differ" in text and "temperature" in text
    assert "3.33× → 6.67× (+100.0%)" in text  # per task
    assert "Question sets differ" in text  # question 4 only ran in A's pld k=8
    assert "Configurations differ" not in compare(a, synthetic_results())


def test_without_hf_the_report_falls_back_to_ar_and_skips_the_bar_chart(tmp_path):
    runs = [r for r in synthetic_runs() if r.label != "hf"]
    paths = write_report(synthetic_results(runs), tmp_path)
    assert [p.name for p in paths] == ["report.md", "acceptance_by_position.png", "k_sweep.png"]
    md = paths[0].read_text()
    assert "Speedup over plain decoding" in md and "| pld k=4 | 1.78× | 2.00× | **1.88×** |" in md
    assert "speedup_by_task.png" not in md
    assert "No runs." in render_markdown(Results())


def test_results_json_reads_back_to_the_same_records():
    results = synthetic_results()
    text = json.dumps(results_json(results))
    again = Results.from_json(json.loads(text))
    assert again.runs == results.runs and again.forward == results.forward
    assert json.dumps(results_json(again)) == text
    # A file written before runs recorded `baseline`: the names it was written under decide.
    old = [{k: v for k, v in run.items() if k != "baseline"} for run in json.loads(text)["runs"]]
    assert [r.baseline for r in Results.from_json({"runs": old}).runs] == [r.baseline for r in results.runs]


def test_a_baseline_is_known_by_its_record_not_its_name(tmp_path):
    # A baseline named like no Hugging Face one (llama.cpp, say) is still a baseline: grouped with
    # them, no speedup model, no acceptance curve, a grey in the figures.
    other = [replace(r, label="llama.cpp", method="llama.cpp", baseline=True, target_forwards=None)
             for r in synthetic_runs() if r.label == "hf"]
    results = synthetic_results(synthetic_runs() + other)
    order = [s.label for s in summary.summarize(results.runs)]
    assert order == ["hf", "llama.cpp", "ar", "pld k=4", "pld k=8"]
    assert "llama.cpp" not in results_json(results)["theory"]
    assert "llama.cpp" not in figure_data(results)["acceptance_by_position.png"]["curves"]
    assert plots.label_styles(summary.summarize(results.runs))["llama.cpp"]["color"] in plots.GREYS
    assert "| llama.cpp |" in render_markdown(results)


def test_the_speedup_model_measures_trees_but_predicts_only_chains():
    trees = [replace(r, label="pld k=4 tree=2x6", tree="2x6")
             for r in synthetic_runs() if r.label == "pld k=4"]
    models = summary.speedup_model(synthetic_runs() + trees, ForwardTimings(dict(BY_TOKENS)))
    chain, tree = models["pld k=4"], models["pld k=4 tree=2x6"]
    assert tree.alpha == chain.alpha == pytest.approx(0.5) and tree.c == chain.c
    assert tree.measured_speedup_vs_ar == pytest.approx(32 / 17) and tree.tree == "2x6"
    assert chain.predicted_speedup == pytest.approx(1.9375) and chain.best_k == 32
    assert tree.predicted_speedup is None and tree.best_k is None  # the chain model is not a tree's


def test_the_cpu_is_named_with_its_family_and_model():
    """A cloud VM's model name may say only "AMD EPYC" on CPUs whose extra verified rows cost
    twofold apart; the description carries CPUID's family and model beside the flags."""
    def cpuinfo(name: str, family: int, model: int, flags: str) -> str:
        first = (f"processor\t: 0\ncpu family\t: {family}\nmodel\t\t: {model}\n"
                 f"model name\t: {name}\nflags\t\t: {flags}\n\n")
        return first + "processor\t: 1\ncpu family\t: 6\nmodel\t\t: 1\nflags\t\t: fpu\n"

    epyc = cpuinfo("AMD EPYC", 25, 17, "fpu avx2 avx512f avx512_bf16")
    assert cpu_description(epyc) == "AMD EPYC [family 25 model 17] (avx2, avx512f, avx512_bf16)"
    xeon = cpuinfo("Intel(R) Xeon(R) Platinum 8581C", 6, 207, "avx2 amx_bf16 amx_int8")
    assert cpu_description(xeon) == ("Intel(R) Xeon(R) Platinum 8581C [family 6 model 207] "
                                     "(avx2, amx_bf16, amx_int8)")
    assert cpu_description("processor\t: 0\nflags\t\t: sse2\n").endswith("(no AVX2)")
