"""`verispec bench --batch-size`: every option it takes is honoured (sampling, seeded; trees,
typical acceptance, a draft model, the drafting options, warm-up), the others refused by name."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from verispec.bench import batched
from verispec.bench.batched import BatchBenchConfig, contender_options
from verispec.cli import main
from verispec.core.tree import TreeSettings
from verispec.options import DraftOptions


def bench(tiny_dir: Path, questions: Path, out: Path, *extra: str) -> dict:
    """A small batched bench (2 prompts, one batch of 2, 8 new tokens, no warm-up): its batched.json."""
    command = ["bench", "--model", str(tiny_dir), "--questions", str(questions), "--batch-size", "2",
               "--max-new-tokens", "8", "--warmup", "0", "--out", str(out), *extra]
    assert main(command) == 0
    return json.loads((out / "batched.json").read_text())


def rows(results: dict) -> dict[str, list[list[int]]]:
    return {label: record["rows"] for label, record in results["sizes"]["2"].items()}


@pytest.fixture(scope="module")
def greedy(tiny_dir, questions, tmp_path_factory) -> dict:
    """The greedy run the sampled ones are compared with."""
    out = tmp_path_factory.mktemp("greedy")
    results = bench(tiny_dir, questions, out, "--methods", "pld")
    assert ", greedy;" in (out / "batched.md").read_text()
    return results


def test_a_temperature_samples_and_the_seed_repeats_it(tiny_dir, questions, tmp_path, greedy):
    sampled = bench(tiny_dir, questions, tmp_path / "a", "--methods", "pld", "--temperature", "0.8",
                    "--seed", "1")
    again = bench(tiny_dir, questions, tmp_path / "b", "--methods", "pld", "--temperature", "0.8",
                  "--seed", "1")
    other = bench(tiny_dir, questions, tmp_path / "c", "--methods", "pld", "--temperature", "0.8",
                  "--seed", "2")
    assert set(rows(sampled)) == {"hf", "ar", "pld"}
    for label in ("hf", "ar", "pld"):  # every contender samples, and repeats with its seed
        assert rows(sampled)[label] != rows(greedy)[label], label
        assert rows(sampled)[label] == rows(again)[label], label
        assert rows(sampled)[label] != rows(other)[label], label
    assert rows(greedy)["pld"] == rows(greedy)["ar"] == rows(greedy)["hf"]
    assert greedy["sizes"]["2"]["pld"]["identical_to_ar"] == "2/2"
    assert sampled["sizes"]["2"]["pld"]["identical_to_ar"] is None  # samples are not compared
    report = (tmp_path / "a" / "batched.md").read_text()
    assert "sampled (temperature 0.8, top-k off, top-p 1.0, seed 1" in report


def test_top_k_and_top_p_reach_every_contender(tiny_dir, questions, tmp_path, greedy):
    """Truncated to the likeliest token, sampling at the seed that differs from greedy above
    gives greedy's rows: for hf, ar and the method alike."""
    for flag, value in (("--top-k", "1"), ("--top-p", "0.000001")):
        results = bench(tiny_dir, questions, tmp_path / flag, "--methods", "pld", "--temperature", "0.8",
                        "--seed", "1", flag, value)
        assert rows(results) == rows(greedy), flag
        assert results["config"][flag.removeprefix("--").replace("-", "_")] == float(value)


def test_trees_typical_and_a_draft_model_run_as_their_own_contenders(tiny_dir, questions, tmp_path):
    # the target as its own draft model: every draft accepted
    greedy = bench(tiny_dir, questions, tmp_path / "greedy", "--methods", "pld,draft", "--draft",
                   str(tiny_dir), "--tree", "2x4")
    assert set(rows(greedy)) == {"hf", "ar", "pld", "pld tree=2x4", "draft", "draft tree=2x4"}
    for label, record in greedy["sizes"]["2"].items():  # greedy: every one exact
        assert record["identical_to_ar"] == "2/2", label
    assert greedy["sizes"]["2"]["draft"]["tau"] > 2 and greedy["sizes"]["2"]["draft tree=2x4"]["tau"] > 2
    sampled = bench(tiny_dir, questions, tmp_path / "typical", "--methods", "pld", "--temperature", "0.8",
                    "--typical")
    assert set(rows(sampled)) == {"hf", "ar", "pld", "pld typical"}
    assert "typical acceptance is LOSSY" in (tmp_path / "typical" / "batched.md").read_text()


def test_each_contender_gets_its_options():
    config = BatchBenchConfig(model="m", out=Path("o"), batch_sizes=[1], methods=["pld", "self-int4-pld"],
                              ks=[2, 3], trees=[TreeSettings(2, 4)], temperature=0.5, typical=True,
                              options=DraftOptions(max_ngram=3, draft="unused/by/pld"))
    found = contender_options(config, None)
    assert found["ar"] == ("ar", DraftOptions(max_ngram=3))
    tree = DraftOptions(k=3, max_ngram=3, tree=TreeSettings(2, 4), acceptance="typical")
    assert found["pld k=3 tree=2x4 typical"] == ("pld", tree)
    assert "self-int4-pld k=2 typical" in found and not any("self-int4-pld" in label and "tree" in label
                                                             for label in found)  # chains only
    assert len(found) == 1 + 2 * 2 * 2 + 2 * 2


def test_warmup_runs_each_contender_that_many_times(tiny_dir, questions, tmp_path, monkeypatch):
    calls = []
    build = batched.hf_batched

    def counted(*args):
        decode = build(*args)
        return lambda prompts: calls.append(len(prompts)) or decode(prompts)

    monkeypatch.setattr(batched, "hf_batched", counted)
    bench(tiny_dir, questions, tmp_path / "out", "--methods", "pld", "--warmup", "2")
    assert calls == [2, 2, 2]  # two warm-ups, then the one batch of 2


@pytest.mark.parametrize(("extra", "error"), [
    (["--trained", "x"], "it takes no --trained"),
    (["--methods", "pld", "--typical"], "--typical compares typical acceptance under sampling"),
    (["--methods", "self-int4-pld", "--tree", "2x4"], "--tree: none of self-int4-pld drafts trees"),
    (["--methods", "pld", "--draft", "x"], "--draft: none of pld runs a draft model"),
    (["--methods", "pld", "--temperature", "0.8", "--top-p", "0"], "top_p must be in (0, 1]"),
    (["--methods", "pld", "--warmup", "-1"], "--warmup must be >= 0"),
    (["--methods", "pld", "--repeats", "2"], "--repeats times one path's runs"),
])
def test_what_it_cannot_honour_is_refused_by_name(tiny_dir, questions, tmp_path, capsys, extra, error):
    out = tmp_path / "refused"
    command = ["bench", "--model", str(tiny_dir), "--questions", str(questions), "--batch-size", "2",
               "--out", str(out), *extra]
    assert main(command) == 2
    assert error in capsys.readouterr().err
    assert not out.exists()
