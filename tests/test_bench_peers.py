"""External peers run in child processes: a peer that dies (a signal, an exit, an exception)
loses its own row, named in the report and results.json, and every other row stands."""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Callable

import pytest

from verispec.bench.baselines import BASELINES, Baseline
from verispec.bench.contender import Outcome
from verispec.bench.peer_process import Job, PeerCrashed, PeerProcess, death
from verispec.bench.runner import BenchConfig, run_bench
from verispec.core.errors import VerispecError


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
