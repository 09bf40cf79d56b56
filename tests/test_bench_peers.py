"""External peers run in child processes: a peer that dies (a signal, an exit, an exception)
loses its own row, named in the report and results.json, and every other row stands."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
from collections.abc import Callable
from itertools import islice

import pytest

from verispec.bench.baselines import BASELINES, Baseline
from verispec.bench.contender import Outcome
from verispec.bench.llamacpp import llamacpp_decoder
from verispec.bench.peer_process import Job, PeerCrashed, PeerProcess, death
from verispec.bench.runner import BenchConfig, run_bench
from verispec.core.errors import VerispecError
from verispec.model.loading import DEFAULT_MODEL, builtin_gguf


def start_dying(how: str, after: int = 0) -> Callable[[list[int]], Outcome]:
    """A test peer (run in the child): answers `after` prompts, then dies `how`."""
    if how == "refuse":
        raise VerispecError("this peer refuses the target")
    answered = [0]

    def generate(prompt_ids: list[int]) -> Outcome:
        if answered[0] == after:
            if how == "SIGILL":
                os.kill(os.getpid(), signal.SIGILL)
            if how == "exit":
                os._exit(3)
            raise RuntimeError("the peer's own bug")
        answered[0] += 1
        return Outcome(prompt_ids[:2], 0.5, None)

    return generate


def dying(how: str, after: int = 0) -> Baseline:
    return Baseline(lambda name, target, draft, config, sampling:
                    Job(start_dying, {"how": how, "after": after}))


@pytest.mark.parametrize(("how", "after", "why"), [("SIGILL", 0, "SIGILL"), ("exit", 1, "exit 3")])
def test_a_peer_that_dies_loses_its_row_only(how, after, why, tiny_dir, questions, tmp_path, monkeypatch):
    monkeypatch.setitem(BASELINES, "doomed", dying(how, after))
    out = tmp_path / "bench"
    config = BenchConfig(model=str(tiny_dir), out=out, questions=questions, max_new_tokens=8, warmup=0,
                         methods=["doomed", "pld"])
    results = run_bench(config, progress=False)
    on_disk = json.loads((out / "results.json").read_text())
    where = "on qa #2" if after else "on mt_bench #1"
    assert on_disk["config"]["crashed"] == {"doomed": f"crashed ({why}) {where}"}
    by_label = {label: [r for r in results.runs if r.label == label]
                for label in ("hf", "ar", "pld", "doomed")}
    assert [len(by_label[label]) for label in ("hf", "ar", "pld")] == [2, 2, 2]  # every other row stands
    assert len(by_label["doomed"]) == after  # its runs before the crash stand
    assert all(r.identical_to_baseline for r in by_label["pld"] + by_label["hf"])
    assert all(r.peak_rss_mib > 0 for r in results.runs)  # the child measured its own
    report = (out / "report.md").read_text()
    assert f"doomed — crashed ({why})" in report and "| pld |" in report and "| hf |" in report


def test_crashes_are_told_apart(tiny_dir):
    for how, why in (("SIGILL", "SIGILL"), ("exit", "exit 3"), ("raise", "RuntimeError: the peer's own bug")):
        peer = PeerProcess("doomed", Job(start_dying, {"how": how, "after": 1}), threads=1)
        assert peer.generate([5, 6, 7]).tokens == [5, 6]
        for _ in range(2):  # once dead, always dead
            with pytest.raises(PeerCrashed, match=f"doomed crashed \\({why}\\)"):
                peer.generate([5, 6, 7])
        peer.close()
    assert death(-signal.SIGSEGV) == "SIGSEGV" and death(0) == "exit 0"


def test_a_peer_that_refuses_stops_the_bench_before_it_runs(tiny_dir, questions, tmp_path, monkeypatch):
    monkeypatch.setitem(BASELINES, "picky", dying("refuse"))
    with pytest.raises(VerispecError, match="this peer refuses the target"):
        run_bench(BenchConfig(model=str(tiny_dir), out=tmp_path / "out", questions=questions,
                              methods=["picky"], warmup=0), progress=False)
    assert not (tmp_path / "out").exists()


NEEDS_LLAMACPP = pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None,
                                    reason="the llamacpp extra: make llamacpp")


@NEEDS_LLAMACPP
def test_llamacpp_decode_loop_runs_the_gguf_as_generate_does():
    """The low-level loop (llama.cpp's greedy sampler) decodes what llama-cpp-python's generate()
    decodes with the same context settings (llama.cpp's defaults turn flash attention on here;
    llama-cpp-python's leave it off, which changes bits), prefills anew each run, and stops at an
    end token or max_new_tokens."""
    from llama_cpp import Llama

    gguf, prompt = builtin_gguf(DEFAULT_MODEL), list(range(400, 440))
    decode = llamacpp_decoder(gguf, threads=1, max_new_tokens=12, eos=set())
    first = decode(prompt)
    assert len(first.tokens) == 12 and first.seconds > 0 and first.target_forwards is None
    assert decode(prompt).tokens == first.tokens  # the cache is cleared: the same run again
    reference = Llama(model_path=str(gguf), n_threads=1, flash_attn=True, verbose=False)
    assert list(islice(reference.generate(prompt, top_k=1, temp=0.0), 12)) == first.tokens
    end = first.tokens[3]
    assert llamacpp_decoder(gguf, 1, 12, {end})(prompt).tokens == first.tokens[:first.tokens.index(end)]


@pytest.mark.slow  # the built-in 4-bit target and llama.cpp: .ci/run's bench covers it on every CI run
@NEEDS_LLAMACPP
def test_bench_runs_llamacpp_in_its_own_process(questions, tmp_path):
    out = tmp_path / "bench"
    results = run_bench(BenchConfig(model=DEFAULT_MODEL, dtype="int4", out=out, questions=questions,
                                    max_new_tokens=16, warmup=0, methods=["llama.cpp", "llama.cpp-lookup"]),
                        progress=False)
    assert not results.config["crashed"]
    for label in ("llama.cpp", "llama.cpp-lookup"):
        runs = [r for r in results.runs if r.label == label]
        assert len(runs) == 2 and all(r.peer and r.new_tokens > 0 for r in runs)
