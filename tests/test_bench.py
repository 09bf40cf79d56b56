"""`verispec bench` end to end on a tiny model and two questions."""

from __future__ import annotations

import json
import re
from dataclasses import replace

import pytest

import verispec.request
from verispec.bench import baselines, runner
from verispec.bench.records import Results
from verispec.bench.report import results_json
from verispec.bench.runner import BenchConfig, choose_methods, run_bench
from verispec.cli import main
from verispec.core import cores
from verispec.core.cores import usable_cores
from verispec.core.errors import VerispecError
from verispec.core.tree import TreeSettings
from verispec.methods import METHODS, Method, resolve
from verispec.options import DEFAULT_TREE
from verispec.verifiers import greedy

RUN_FIELDS = {"method", "task", "question_id", "k", "new_tokens", "seconds", "target_forwards",
              "mean_accepted_tokens", "identical_to_baseline"}
SUMMARY_FIELDS = {"speedup_vs_hf", "speedup_vs_ar", "mean_accepted_tokens", "tokens_per_second",
                  "identical"}


def config(tiny_dir, questions, out, **kwargs):
    return BenchConfig(model=str(tiny_dir), out=out, questions=questions, max_new_tokens=12,
                       warmup=0, exit_layer=1, **kwargs)


def test_the_bench_resolves_each_method_once_per_run(tiny_dir, questions, tmp_path, monkeypatch):
    """One check of a method and its options per contender, not one per question (two questions
    and a warm-up here)."""
    resolved = []

    def counted(method, options):
        resolved.append(method)
        return resolve(method, options)

    monkeypatch.setattr(verispec.request, "resolve", counted)
    setting = replace(config(tiny_dir, questions, tmp_path / "once", methods=["pld"]), warmup=1)
    run_bench(setting, progress=False)
    assert sorted(resolved) == ["ar", "pld"]


def test_bench_writes_every_field_report_and_plots(tiny_dir, questions, tmp_path):
    out = tmp_path / "bench"
    results = run_bench(config(tiny_dir, questions, out, ks=[2, 4]), progress=False)
    on_disk = json.loads((out / "results.json").read_text())
    assert on_disk == json.loads(json.dumps(results_json(results)))
    assert {"config", "machine", "runs", "summary"} <= set(on_disk)
    labels = {r["label"] for r in on_disk["runs"]}
    assert {"hf", "ar", "hf-pld", "hf-early-exit", "pld k=2", "pld k=4", "early-exit k=2", "lookahead k=4",
            "self-int4 k=2", "self-int4-pld k=4", "self-int8 k=2", "self-bf16 k=4"} <= labels
    assert "int4 g32" in on_disk["config"]["drafters"]["self-int4 k=2"]["runs"]  # the kernel it chose
    assert on_disk["summary"]["self-int4-pld k=4"]["overall"]["identical"] == "2/2"
    for run in on_disk["runs"]:
        assert RUN_FIELDS <= set(run) and run["peak_rss_mib"] > 0
        assert run["new_tokens"] == 12 and run["seconds"] > 0
    assert {r["task"] for r in on_disk["runs"]} == {"mt_bench", "qa"}
    for label, tasks in on_disk["summary"].items():
        assert {"mt_bench", "qa", "overall"} <= set(tasks), label
        assert SUMMARY_FIELDS <= set(tasks["overall"])
    # Lossless methods are identical to ar on every question.
    assert on_disk["summary"]["pld k=4"]["overall"]["identical"] == "2/2"
    assert on_disk["summary"]["hf"]["overall"]["identical"] == "2/2"
    report = (out / "report.md").read_text()
    assert "pld k=4" in report and "hf-pld" in report
    assert "## Drafters and memory" in report and "avx" in on_disk["machine"]["processor"].lower()
    assert on_disk["machine"]["usable_cores"] == usable_cores()  # a container's quota, not its host's CPUs
    # which path ran: the lean forward of the Llama family, row-invariant, its kernel named
    assert on_disk["config"]["path"] == "lean (llama)" and "**forward**: lean (llama)" in report
    assert on_disk["config"]["invariance"] == "row-attention" and "prepacked" in on_disk["config"]["kernel"]
    # A float32 model on CPU runs prepacked; the report compares with its own linear layers.
    forward = on_disk["forward"]
    assert set(forward["by_tokens"]) == set(forward["unpacked_by_tokens"]) == {"1", "2", "4", "8", "16"}
    assert "prepacked: " in report
    for png in ("speedup_by_task.png", "acceptance_by_position.png", "k_sweep.png"):
        assert (out / png).stat().st_size > 1000


def test_exactness_check_catches_a_wrong_method(tiny_dir, questions, tmp_path, monkeypatch):
    """A verifier made to accept every draft: the bench must report the difference and its gap."""

    def accept_everything(draft_tokens, target_logits):
        return draft_tokens.shape[0], int(target_logits[-1].argmax())

    monkeypatch.setattr(greedy, "greedy_accept", accept_everything)
    out = tmp_path / "broken"
    results = run_bench(config(tiny_dir, questions, out, methods=["early-exit"], ks=[4]), progress=False)
    broken = [r for r in results.runs if r.label == "early-exit"]
    assert any(r.identical_to_baseline is False for r in broken)
    difference = next(r.first_difference for r in broken if r.identical_to_baseline is False)
    assert difference.logit_gap > 0  # the baseline token scores higher: not a tie, a bug
    assert abs(difference.baseline_logit) < float("inf")  # recorded: the tie limit scales with it
    assert results_json(results)["summary"]["early-exit"]["overall"]["identical"] != "2/2"
    assert "early-exit" in (out / "report.md").read_text()


def test_bench_validates_before_running(tiny_dir, questions, tmp_path):
    with pytest.raises(VerispecError, match="unknown method"):
        run_bench(config(tiny_dir, questions, tmp_path / "a", methods=["warp-drive"]), progress=False)
    with pytest.raises(VerispecError, match="need a draft model"):
        run_bench(config(tiny_dir, questions, tmp_path / "b", methods=["draft"]), progress=False)
    with pytest.raises(VerispecError, match="does not exist"):
        run_bench(config(tiny_dir, tmp_path / "none.jsonl", tmp_path / "c"), progress=False)
    with pytest.raises(VerispecError, match="--repeats must be >= 1"):
        run_bench(config(tiny_dir, questions, tmp_path / "d", methods=["pld"], repeats=0), progress=False)
    assert not any((tmp_path / name).exists() for name in "abcd")


def test_repeats_keep_the_median_and_every_round_drafts_from_the_same_outputs(tiny_dir, questions,
                                                                              tmp_path, monkeypatch):
    """--repeats 3: a record is the run of median seconds, with all three runs' seconds; what a
    round adds to the suffix caches is dropped before the next, so suffix drafts alike in every
    round (had its first answer stayed, the next round would draft the whole of it back: fewer
    target forwards); the report names the repeats and gives each method's spread."""
    rounds = {}
    median_run = runner.median_run

    def recorded(outcomes):
        rounds.setdefault(len(rounds), outcomes)
        return median_run(outcomes)

    monkeypatch.setattr(runner, "median_run", recorded)
    out = tmp_path / "repeats"
    results = run_bench(config(tiny_dir, questions, out, methods=["suffix"], repeats=3), progress=False)
    assert {run.label for run in results.runs} == {"hf", "ar", "suffix"}
    for run in results.runs:
        assert len(run.repeat_seconds) == 3 and run.seconds == sorted(run.repeat_seconds)[1]
    suffix = [outcomes for outcomes in rounds.values() if outcomes[0].stats is not None
              and outcomes[0].stats.drafted_by_position]
    assert suffix, "suffix drafted in none of the runs"
    for outcomes in suffix:
        assert len({o.target_forwards for o in outcomes}) == 1, [o.target_forwards for o in outcomes]
        assert len({tuple(o.tokens) for o in outcomes}) == 1
    report = (out / "report.md").read_text()
    assert "**repeats**: 3" in report and "| spread |" in report


@pytest.mark.slow  # 21 s on the AVX2 EPYC
def test_a_method_at_two_ks_never_drafts_the_others_answer_to_the_same_question(tiny_dir, questions,
                                                                               tmp_path):
    """`--k 4,8` runs suffix decoding twice on each question, both variants sharing its cache of
    earlier answers: each drafts as it does when it runs alone (the same target forwards on every
    question), neither from the other's answer to the question both answer."""
    def forwards(ks: list[int], out: str) -> dict[tuple[int | None, int], int | None]:
        results = run_bench(config(tiny_dir, questions, tmp_path / out, methods=["suffix"], ks=ks),
                            progress=False)
        return {(run.k, run.question_id): run.target_forwards for run in results.runs
                if run.method == "suffix"}

    both = forwards([4, 8], "both")
    assert len(both) == 4 and both == forwards([4], "four") | forwards([8], "eight")


def test_the_report_says_what_auto_chose(tiny_dir, questions, tmp_path):
    """auto's stretches are kept on its runs, through results.json, and the report counts every
    new token of every question once, under the method that drafted it."""
    out = tmp_path / "auto"
    run_bench(config(tiny_dir, questions, out, methods=["auto"]), progress=False)
    results = Results.load(out / "results.json")
    runs = [r for r in results.runs if r.method == "auto"]
    assert runs and all(r.choices and r.choices[0][0] == 0 for r in runs)
    assert not any(r.choices for r in results.runs if r.method != "auto")
    section = (out / "report.md").read_text().split("## What `auto` chose", 1)[1].split("\n## ", 1)[0]
    [row] = [line for line in section.splitlines() if line.startswith("| auto |")]
    counted = sum(int(n) for n in re.findall(r"(\d+) tokens in", row))
    assert counted == sum(r.new_tokens for r in runs) > 0


def test_a_busy_machine_is_said_where_the_timings_are_read(tiny_dir, questions, tmp_path, monkeypatch,
                                                           capsys):
    """Other processes' load during the timed runs (counted with the bench's own child processes,
    its peers, as its own) goes to results.json, and where it took cores the bench's threads
    needed, the report and stderr say the timings are not the machine's alone."""
    made = []

    class Loaded(cores.OthersLoad):
        def __exit__(self, *exc: object) -> None:
            made.append(self.children)
            self.cores = self.capacity  # every core busy beside the bench

    monkeypatch.setattr(runner, "OthersLoad", Loaded)
    out = tmp_path / "busy"
    run_bench(config(tiny_dir, questions, out, methods=["pld"]), progress=False)
    assert made == [True]
    saved = Results.load(out / "results.json").config
    assert saved["crowded"] and saved["others_busy_cores"] == saved["cores"] == cores.capacity()[0]
    assert "**busy machine**: other processes kept" in (out / "report.md").read_text()
    assert "its timings are not this machine's alone" in capsys.readouterr().err
    monkeypatch.undo()  # the real count: whatever it read, a figure or None, and no claim unless took
    run_bench(config(tiny_dir, questions, tmp_path / "real", methods=["pld"]), progress=False)
    saved = Results.load(tmp_path / "real" / "results.json").config
    assert "others_busy_cores" in saved and saved.get("crowded", False) == ("busy machine" in (
        tmp_path / "real" / "report.md").read_text())

def test_compare_prints_the_change(tiny_dir, questions, tmp_path, capsys):
    out = tmp_path / "one"
    run_bench(config(tiny_dir, questions, out, methods=["pld"]), progress=False)
    assert main(["bench", "--compare", str(out / "results.json"), str(out / "results.json")]) == 0
    assert "pld" in capsys.readouterr().out


DEFAULT_SET = {"hf", "ar", "auto", "pld", "hf-pld", "early-exit", "hf-early-exit", "lookahead", "eagle",
               "eagle-pld", "eagle-suffix",
               "eagle3", "medusa", "draft", "self-int4", "self-int8", "self-bf16", "self-int4-pld", "suffix",
               "block"}


def test_the_default_set_is_the_registrys(tmp_path, monkeypatch):
    everything = BenchConfig(model="unused", out=tmp_path)
    assert set(choose_methods(everything)) == DEFAULT_SET  # the model can run every method
    assert set(choose_methods(replace(everything, draft="small"))) == DEFAULT_SET | {"hf-assisted"}
    # A method is left out where the model cannot run it, and its Hugging Face peer with it.
    chosen = choose_methods(everything, lambda method: method.hf_peer != "hf-pld")
    assert "hf-pld" not in chosen and "hf-early-exit" in chosen and "lookahead" in chosen

    # A method registered with bench=True is chosen after its peer; one set to bench=False is not.
    toy = Method("toy-bench", "a test's method", 2, lambda target, options: None, hf_peer="hf-pld")
    monkeypatch.setitem(METHODS, toy.name, toy)
    monkeypatch.setitem(METHODS, "pld", replace(METHODS["pld"], bench=False))
    chosen = choose_methods(everything)
    assert "toy-bench" in chosen and "pld" not in chosen
    assert chosen[chosen.index("toy-bench") - 1] == "hf-pld"
    assert chosen[:2] == ["hf", "ar"]


def test_ctrl_c_keeps_what_was_measured(tiny_dir, questions, tmp_path, monkeypatch):
    """An interrupt during the second question leaves the first question's runs written."""
    from verispec.bench import runner

    real = runner.run_record
    calls = {"n": 0}

    def record_then_interrupt(contender, question, outcome):
        if question.question_id == 2:
            raise KeyboardInterrupt
        calls["n"] += 1
        return real(contender, question, outcome)

    monkeypatch.setattr(runner, "run_record", record_then_interrupt)
    out = tmp_path / "interrupted"
    results = run_bench(config(tiny_dir, questions, out, methods=["pld"]), progress=False)
    on_disk = json.loads((out / "results.json").read_text())
    assert on_disk["config"]["interrupted"] is True
    assert len(on_disk["runs"]) == calls["n"] > 0
    assert {r["question_id"] for r in on_disk["runs"]} == {1}
    assert (out / "report.md").is_file() and results.runs


def test_bench_runs_trees_beside_chains_and_labels_typical_lossy(tiny_dir, questions, tmp_path):
    out = tmp_path / "trees"
    results = run_bench(config(tiny_dir, questions, out, methods=["pld"], trees=[TreeSettings(3, 8)],
                               temperature=0.8, typical=True), progress=False)
    labels = {r.label: r for r in results.runs}
    assert {"pld", "pld tree=3x8", "pld typical", "pld tree=3x8 typical"} <= set(labels)
    assert labels["pld tree=3x8"].tree == "3x8" and labels["pld"].tree is None
    report = (out / "report.md").read_text()
    assert "pld typical (lossy)" in report and "Tree methods (pld tree=3x8" in report
    assert "## Trees against chains" in report and "| pld tree=3x8 | 3x8 | 8 |" in report


def test_bench_default_tree_is_each_methods_own(tiny_dir, questions, tmp_path):
    # 'default' runs pld's measured default tree; early-exit has none, so only its chain runs.
    results = run_bench(config(tiny_dir, questions, tmp_path / "default", methods=["pld", "early-exit"],
                               trees=[DEFAULT_TREE]), progress=False)
    tree = METHODS["pld"].default_tree
    labels = {r.label for r in results.runs}
    assert labels == {"ar", "hf", "pld", f"pld tree={tree.topk}x{tree.nodes}", "early-exit"}


def test_the_bench_runs_each_method_as_it_runs_by_default(tiny_dir, questions, tmp_path, monkeypatch):
    """Without --k the bench asks a method for no k (the eagles then draw their shape from the
    profile, as a user's run does) and reports the method's default k; with --k, that k."""
    asked = []

    def counted(method, options):
        asked.append((method, options.k))
        return resolve(method, options)

    monkeypatch.setattr(verispec.request, "resolve", counted)
    results = run_bench(config(tiny_dir, questions, tmp_path / "k", methods=["pld"]), progress=False)
    assert ("pld", None) in asked and {r.label: r.k for r in results.runs}["pld"] == METHODS["pld"].default_k
    asked.clear()
    results = run_bench(config(tiny_dir, questions, tmp_path / "k3", methods=["pld"], ks=[3]), progress=False)
    assert ("pld", 3) in asked and {r.label: r.k for r in results.runs}["pld"] == 3


def test_typical_without_sampling_is_refused(tiny_dir, questions, tmp_path):
    with pytest.raises(VerispecError, match="temperature"):
        run_bench(config(tiny_dir, questions, tmp_path / "x", methods=["pld"], typical=True),
                  progress=False)


def test_batched_bench_measures_every_size_and_checks_rows(tiny_dir, questions, tmp_path, capsys):
    out = tmp_path / "batched"
    code = main(["bench", "--model", str(tiny_dir), "--questions", str(questions), "--batch-size", "1,3",
                 "--methods", "pld,self-int4-pld", "--max-new-tokens", "10", "--out", str(out)])
    assert code == 0
    results = json.loads((out / "batched.json").read_text())
    assert list(results["sizes"]) == ["1", "3"]
    for size in ("1", "3"):
        row = results["sizes"][size]
        assert set(row) == {"hf", "ar", "pld", "self-int4-pld"}
        assert all(r["tokens_per_second"] > 0 for r in row.values())
        total = row["ar"]["identical_to_ar"].split("/")[1]
        assert row["pld"]["identical_to_ar"] == f"{total}/{total}"  # greedy rows are exact
        assert row["self-int4-pld"]["tau"] >= 1
    assert (out / "batched.png").stat().st_size > 10_000
    report = (out / "batched.md").read_text()
    assert "| self-int4-pld |" in report and "batch 3" in report
    assert "Batched throughput" in capsys.readouterr().out
    assert main(["bench", "--model", str(tiny_dir), "--questions", str(questions), "--batch-size", "0",
                 "--out", str(tmp_path / "bad")]) != 0
    assert "--batch-size takes positive integers" in capsys.readouterr().err
    assert not (tmp_path / "bad").exists()


def test_llamacpp_baselines_need_the_targets_gguf(tiny_dir, questions, tmp_path, monkeypatch):
    """Refused before any peer's process starts (Hugging Face's `hf` row loads the target in one:
    seconds a refusal need not take)."""
    def no_peer(*args):
        raise AssertionError("a peer process started before the bench refused")
    monkeypatch.setattr(baselines, "PeerProcess", no_peer)
    for name in ("llama.cpp", "llama.cpp-lookup"):
        with pytest.raises(VerispecError, match="GGUF"):
            run_bench(config(tiny_dir, questions, tmp_path / name, methods=[name]), progress=False)


def test_no_load_cap_without_batches_is_refused_by_name(tiny_dir, questions, tmp_path, capsys):
    out = tmp_path / "refused"
    assert main(["bench", "--model", str(tiny_dir), "--questions", str(questions), "--no-load-cap",
                 "--methods", "pld", "--out", str(out)]) == 2
    assert "--no-load-cap sets the draft length at each batch size" in capsys.readouterr().err
    assert not out.exists()


def test_a_trained_drafter_given_as_draft_runs_as_generate_runs_it(tiny_dir, tiny_trained, questions,
                                                                    tmp_path):
    """`--draft DIR` with a trained drafter directory (what `generate --draft` takes) drafts the
    trained method with it, as `--trained DIR` does, instead of loading DIR as a draft model."""
    out = tmp_path / "given"
    code = main(["bench", "--model", str(tiny_dir), "--questions", str(questions), "--methods", "eagle",
                 "--draft", str(tiny_trained["eagle"]), "--max-new-tokens", "12", "--warmup", "0",
                 "--out", str(out)])
    assert code == 0
    results = json.loads((out / "results.json").read_text())
    assert {r["method"] for r in results["runs"]} == {"hf", "ar", "eagle"}
    assert all(r["identical_to_baseline"] for r in results["runs"] if r["method"] == "eagle")
    assert results["config"]["trained"] == [str(tiny_trained["eagle"])], results["config"]
