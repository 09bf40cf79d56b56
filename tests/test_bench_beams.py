"""`verispec bench --num-beams B` on a tiny model and two questions: every contender runs beam
search, Hugging Face's generate(num_beams=B) is the reference, and what cannot run beam search is
refused by name."""

from __future__ import annotations

import json

import pytest

from tests.test_bench import config
from verispec.bench.runner import BenchConfig, build_contenders, run_bench
from verispec.cli import main
from verispec.core.errors import VerispecError
from verispec.core.tree import TreeSettings
from verispec.core.types import SamplingParams
from verispec.decoding.beam import BeamSearch, BeamSettings
from verispec.model.loading import load_model


def test_bench_with_beams_names_b_and_counts_best_sequences_equal_to_hf(tiny_dir, questions, tmp_path,
                                                                         capsys):
    out = tmp_path / "beams"
    assert main(["bench", "--model", str(tiny_dir), "--questions", str(questions), "--num-beams", "2",
                 "--length-penalty", "0.5", "--early-stopping", "never", "--methods", "pld,self-int4",
                 "--max-new-tokens", "12", "--warmup", "0", "--out", str(out)]) == 0
    report = capsys.readouterr().out
    results = json.loads((out / "results.json").read_text())
    assert results["config"]["beams"] == {"num_beams": 2, "length_penalty": 0.5, "early_stopping": "never",
                                          "num_return_sequences": 1}
    assert {r["label"] for r in results["runs"]} == {"hf", "ar", "pld", "self-int4"}
    assert all(r["search_steps"] >= r["target_forwards"] > 0 for r in results["runs"])
    overall = {label: tasks["overall"] for label, tasks in results["summary"].items()}
    assert overall["hf"]["identical"] == "-"  # the reference
    for label in ("ar", "pld", "self-int4"):
        assert overall[label]["identical"] == "2/2", label
        assert overall[label]["seconds"] > 0 and overall[label]["speedup_vs_hf"] > 0
    assert overall["hf"]["search_steps_per_pass"] == overall["ar"]["search_steps_per_pass"] == 1.0
    assert overall["self-int4"]["search_steps_per_pass"] > 1.0  # the drafts advanced the search
    assert results["theory"] == {}  # Leviathan et al.'s model is for one path
    assert ("- **beam search**: B = 2 (num_beams) · **length_penalty**: 0.5 · **early_stopping**: never"
            in report)
    assert "## Beam search (B = 2): speedup over Hugging Face generate(num_beams=2)" in report
    assert "| steps/pass | seconds | tok/s | = hf |" in report
    assert "All 6 compared runs are identical to `hf`, token for token." in report


def test_a_best_sequence_unlike_hfs_is_counted(tiny_dir, questions, tmp_path, monkeypatch):
    """verispec's beam search made to drop each best sequence's last token: every verispec run
    differs from Hugging Face's, and the report says so."""
    real = BeamSearch.best
    monkeypatch.setattr(BeamSearch, "best",
                        lambda self: [(tokens[:-1], score) for tokens, score in real(self)])
    out = tmp_path / "broken"
    results = run_bench(config(tiny_dir, questions, out, methods=["pld"], beams=BeamSettings(2)),
                        progress=False)
    broken = [r for r in results.runs if r.label in ("ar", "pld")]
    assert len(broken) == 4 and not any(r.identical_to_baseline for r in broken)
    assert all(r.first_difference.position == 11 and r.first_difference.ours is None for r in broken)
    report = (out / "report.md").read_text()
    assert "4 of 4 compared runs differ from `hf`" in report and "summed log-probs" in report
    assert "| pld | mt_bench | 1 | 11 |" in report


def test_what_cannot_run_beam_search_is_refused_by_name(tiny_dir, questions, tmp_path, capsys):
    beams = BeamSettings(2)
    with pytest.raises(VerispecError) as refused:
        run_bench(config(tiny_dir, questions, tmp_path / "a", methods=["pld", "lookahead", "hf-pld"],
                         beams=beams), progress=False)
    message = str(refused.value)
    assert message.startswith("--num-beams 2: cannot run beam search: ")
    assert "lookahead (" in message and "hf-pld (" in message
    assert " pld (" not in message and not message.startswith("pld (")  # pld can: not named
    for settings, flag in ((dict(temperature=0.7), "--temperature"),
                           (dict(trees=[TreeSettings(2, 4)]), "--tree")):
        with pytest.raises(VerispecError, match=f"--num-beams 2: beam search is greedy.*{flag}"):
            run_bench(config(tiny_dir, questions, tmp_path / "b", methods=["pld"], beams=beams, **settings),
                      progress=False)
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()

    command = ["bench", "--model", str(tiny_dir), "--questions", str(questions), "--out", str(tmp_path / "c")]
    for extra, error in ((["--length-penalty", "2"], "--length-penalty set beam search: give --num-beams"),
                         (["--num-beams", "0"], "num_beams must be a positive integer"),
                         (["--num-beams", "2", "--batch-size", "1"], "it takes no --num-beams")):
        assert main(command + extra) != 0
        assert error in capsys.readouterr().err
    assert not (tmp_path / "c").exists()


def test_the_default_set_leaves_out_what_cannot_run_beam_search(tiny_dir, tmp_path):
    target = load_model(str(tiny_dir))
    setting = BenchConfig(model=str(tiny_dir), out=tmp_path, max_new_tokens=8, exit_layer=1,
                          beams=BeamSettings(2))
    contenders, left_out = build_contenders(setting, target, None, SamplingParams(), [[1, 2]])
    labels = [c.label for c in contenders]
    assert labels[:2] == ["hf", "ar"] and {"pld", "self-int4", "early-exit"} <= set(labels)
    assert {"lookahead", "suffix", "hf-pld", "hf-early-exit"} <= set(left_out)
    assert not set(labels) & set(left_out)
    assert "LookaheadDrafter is not supported" in left_out["lookahead"]
