"""Every registered method on every target, through every front door: it runs exactly, or it is
refused by name before any work.

The matrix: the 20 methods of verispec.methods.METHODS (`ar` and 19 speculation methods) x three
targets (the tiny model in float32, in bfloat16, and as a 4-bit target, `--dtype int4`) x two
decodings (greedy, sampled) x four doors (`verispec.generate`, `verispec generate`, `verispec
bench`, `verispec serve`) = 480 cells (the bench's bfloat16 cells under `slow`). The trained
methods draft with drafters trained for the tiny model (tests/conftest.py, `tiny_trained`:
`--draft DIR`, the bench's `--trained`); without one
they are refused by name before any target forward, at every door
(`test_a_trained_method_without_its_drafter_is_refused_by_name_before_any_work`).

What "exactly" means in a cell:
- greedy: the tokens of plain decoding (`ar`) of the same target through `verispec.generate`;
- sampled, two settings: (a) top-k 1 through the sampling path (do_sample, rejection sampling with
  one-hot p), which must give plain greedy decoding's tokens; (b) temperature 0.9, top-k 5, seed 3:
  the door gives the tokens `verispec.generate` gives for the same seeded request (one request
  path), a seeded repeat gives them again, and every token is among the target's 5 likeliest
  there. That the sampled tokens follow the target's law is tests/test_sampling_drafters.py's.

Each door runs in this process: the CLI through `verispec.cli.main` (the target loaded once per
dtype and handed to it, `load_model` patched), the bench the same way (the tokens it timed read by
wrapping the `run` it calls), the server as a live uvicorn server per drafter directory. Suffix
decoding drafts from the model's earlier outputs too, which changes how many random draws a
sampled answer takes: its cache is emptied before each run (`forget_outputs`). `auto` decides by
given costs here, under which every candidate pays (a profile measured on a busy machine may find
that none does, and `auto` would then rightly draft nothing): tests/test_auto.py measures one.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

import verispec
import verispec.bench.baselines as baselines
import verispec.bench.runner as bench_runner
import verispec.cli.generate as cli_generate
import verispec.cli.serve as cli_serve
import verispec.methods as registry
from tests.serving import LiveServer
from verispec.cli import main
from verispec.core.errors import VerispecError
from verispec.drafters.auto import CostProfile, DrafterCost
from verispec.drafters.suffix import forget_outputs
from verispec.methods import METHODS, PLAIN, Needs
from verispec.model.loading import LoadedModel, load_model
from verispec.options import DraftOptions
from verispec.request import encode_prompt
from verispec.server import create_app

PROMPT = "w10 w11 w12 w10 w11 w12 w10"  # repetitive: lookup methods find drafts
NEW = 12
TARGETS = ("float32", "bfloat16", "int4")
DOORS = ("generate", "cli", "bench", "server")
TOP = 5
SEED = 3
# The sampled settings: (name, temperature, top_k, seed)
SAMPLED = (("top-k 1", 1.0, 1, None), ("t0.9 top-k 5", 0.9, TOP, SEED))
# The methods that need a trained drafter or a draft model (early-exit runs without its trained exit)
TRAINED = [name for name, m in METHODS.items() if m.needs in (Needs.TRAINED, Needs.DRAFT_MODEL)]


def test_the_matrix_covers_every_method_target_decoding_and_door():
    assert len(METHODS) == 21 and len(METHODS) * len(TARGETS) * 2 * len(DOORS) == 504


@pytest.fixture(scope="module", autouse=True)
def paying_costs():
    """auto's profile: a forward that costs the same at any width, cheap good drafters (a seeded
    run is priced by the profile alone, so every door gives one seed's output)."""
    def costs(target, drafters, limits, refresh=False):
        return CostProfile((0.01,) * 17, 300, 1e4, {name: DrafterCost(0.0, 0.0001, 0.9) for name in drafters})
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(registry, "cost_profile", costs)
        yield


@pytest.fixture(scope="module")
def targets(tiny_dir) -> dict[str, LoadedModel]:
    return {dtype: load_model(str(tiny_dir), dtype) for dtype in TARGETS}


@pytest.fixture
def loads(targets, tiny_dir, monkeypatch):
    """The CLI's and the bench's load_model hand out the targets loaded once."""
    def load(spec: str, dtype: str = "float32", device: str = "cpu") -> LoadedModel:
        assert spec == str(tiny_dir) and device == "cpu", spec
        return targets[dtype]
    for module in (cli_generate, cli_serve, bench_runner):
        monkeypatch.setattr(module, "load_model", load)


def drafter_dir(method: str, trained: dict[str, Path]) -> Path | None:
    """The trained drafter a method runs with on the tiny model (None: it needs none)."""
    return trained.get(METHODS[method].trained_kind)


@dataclass
class Reference:
    """What `verispec.generate` gives on one target: plain greedy tokens, and per method the
    seeded sampled run's."""

    greedy: list[int]
    sampled: dict[str, list[int]] = field(default_factory=dict)


def api(target: LoadedModel, method: str, trained: dict, temperature: float = 0.0, top_k: int = 0,
        seed: int | None = None):
    forget_outputs(target.model)
    folder = drafter_dir(method, trained)
    return verispec.generate(target, PROMPT, chat=True, method=method, max_new_tokens=NEW,
                             options=DraftOptions(draft=None if folder is None else str(folder)),
                             do_sample=temperature > 0, temperature=temperature or 1.0, top_k=top_k,
                             seed=seed)


@pytest.fixture(scope="module")
def references(targets, tiny_trained) -> dict[str, Reference]:
    out = {}
    for dtype, target in targets.items():
        plain = api(target, PLAIN, tiny_trained).token_ids
        assert len(plain) == NEW
        out[dtype] = reference = Reference(plain)
        name, temperature, top_k, seed = SAMPLED[1]
        for method in METHODS:
            reference.sampled[method] = api(target, method, tiny_trained, temperature, top_k, seed).token_ids
    return out


def in_top(target: LoadedModel, tokens: list[int], top: int) -> bool:
    """Every token is among the target's `top` likeliest after the prompt and the tokens before
    it (a hair of slack for a tie at the edge in bfloat16)."""
    prompt = encode_prompt(target, PROMPT, chat=True)
    with torch.no_grad():
        logits = target.model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1: -1].float()
    edge = logits.topk(top, dim=-1).values[:, -1]  # [len(tokens)]
    chosen = logits.gather(-1, torch.tensor(tokens)[:, None])[:, 0]
    return bool((chosen >= edge - 1e-3).all())


def expected(reference: Reference, method: str, setting: str) -> list[int]:
    """The tokens a door must give in a cell: plain greedy decoding's under greedy decoding and
    top-k 1, verispec.generate's seeded run's at temperature 0.9."""
    return reference.greedy if setting in ("greedy", SAMPLED[0][0]) else reference.sampled[method]


def settings():
    """(name, temperature, top_k, seed) of each run in a cell's two decodings."""
    return [("greedy", 0.0, 0, None), *SAMPLED]


@pytest.mark.parametrize("dtype", TARGETS)
def test_generate(targets, references, tiny_trained, dtype):
    target, reference = targets[dtype], references[dtype]
    wrong = {}
    for method in METHODS:
        drafted = 0
        for name, temperature, top_k, seed in settings():
            result = api(target, method, tiny_trained, temperature, top_k, seed)
            drafted += sum(step.num_drafted for step in result.steps)
            problem = None if result.token_ids == expected(reference, method, name) else result.token_ids
            if name == SAMPLED[1][0] and problem is None:
                repeat = api(target, method, tiny_trained, temperature, top_k, seed).token_ids
                problem = (None if repeat == result.token_ids else "a seeded repeat differs") or (
                    None if in_top(target, result.token_ids, TOP) else f"a token outside the top {TOP}")
            if problem:
                wrong[(method, name)] = problem
        if method != PLAIN and not drafted:
            wrong[(method, "drafting")] = "drafted nothing"
    assert not wrong, wrong


@pytest.mark.parametrize("dtype", TARGETS)
def test_cli(targets, references, tiny_trained, tiny_dir, loads, capsys, dtype):
    target, reference = targets[dtype], references[dtype]
    wrong = {}
    for method in METHODS:
        folder = drafter_dir(method, tiny_trained)
        for name, temperature, top_k, seed in settings():
            forget_outputs(target.model)
            argv = ["generate", "--model", str(tiny_dir), "--dtype", dtype, "--method", method,
                    "--prompt", PROMPT, "--max-new-tokens", str(NEW), "--json",
                    "--temperature", str(temperature), "--top-k", str(top_k)]
            argv += ([] if seed is None else ["--seed", str(seed)]) + ([] if folder is None else
                                                                     ["--draft", str(folder)])
            code = main(argv)
            out = capsys.readouterr()
            if code != 0:
                wrong[(method, name)] = f"exit {code}: {out.err.strip()}"
                continue
            tokens = json.loads(out.out)["token_ids"]
            if tokens != expected(reference, method, name):
                wrong[(method, name)] = tokens
    assert not wrong, wrong


# the bench's runs (18-31 s each on the AVX2 EPYC) under slow: the other doors run every dtype in
# the default suite, and tests/test_bench.py runs the bench
@pytest.mark.slow
@pytest.mark.parametrize("dtype", TARGETS)
def test_bench(targets, references, tiny_trained, tiny_dir, loads, tmp_path, monkeypatch, capsys, dtype):
    """One bench run per decoding setting with every method named (the bench's own exactness
    check, `identical_to_baseline`, must hold under greedy decoding too)."""
    target, reference = targets[dtype], references[dtype]
    questions = tmp_path / "q.jsonl"
    questions.write_text(json.dumps({"question_id": 1, "category": "writing", "turns": [PROMPT]}) + "\n")
    timed: dict[str, list[int]] = {}
    real_run = bench_runner.run

    def run(target_, request, engine=None):
        result = real_run(target_, request, engine)
        timed[request.method] = result.token_ids
        return result

    monkeypatch.setattr(bench_runner, "run", run)
    wrong = {}
    speculative = [m for m in METHODS if m != PLAIN]
    for name, temperature, top_k, seed in settings():
        timed.clear()
        forget_outputs(target.model)
        out = tmp_path / name.replace(" ", "-")
        code = main(["bench", "--model", str(tiny_dir), "--dtype", dtype, "--questions", str(questions),
                     "--methods", ",".join(speculative), "--max-new-tokens", str(NEW), "--warmup", "0",
                     "--trained", ",".join(str(p) for p in tiny_trained.values()),
                     "--temperature", str(temperature), "--top-k", str(top_k), "--seed", str(seed or 0),
                     "--out", str(out)])
        err = capsys.readouterr().err
        assert code == 0, err
        assert set(timed) == set(METHODS), set(METHODS) - set(timed)
        wrong |= {(method, name): timed[method] for method in METHODS
                  if timed[method] != expected(reference, method, name)}
        if name == "greedy":
            runs = json.loads((out / "results.json").read_text())["runs"]
            assert all(r["identical_to_baseline"] for r in runs if r["method"] in speculative), runs
    assert not wrong, wrong


def server_groups(trained: dict[str, Path]) -> list[tuple[Path | None, list[str]]]:
    """The methods one server can serve together: those needing no drafter, then one server per
    drafter directory (a server's --draft is one directory)."""
    groups: dict[Path | None, list[str]] = {}
    for method in METHODS:
        groups.setdefault(drafter_dir(method, trained), []).append(method)
    return list(groups.items())


@pytest.mark.parametrize("dtype", TARGETS)
def test_server(targets, references, tiny_trained, dtype):
    target, reference = targets[dtype], references[dtype]
    wrong = {}
    for folder, methods in server_groups(tiny_trained):
        options = DraftOptions(draft=None if folder is None else str(folder))
        with LiveServer(create_app(target, methods, options=options)) as live:
            for method in methods:
                for name, temperature, top_k, seed in settings():
                    forget_outputs(target.model)
                    body = {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": NEW,
                            "temperature": temperature, "top_k": top_k, "method": method}
                    if seed is not None:
                        body["seed"] = seed
                    status, _, reply = live.request("/v1/chat/completions", body)
                    if status != 200:
                        wrong[(method, name)] = f"{status}: {reply}"
                        continue
                    text = reply["choices"][0]["message"]["content"]
                    want = target.tokenizer.decode(expected(reference, method, name),
                                                   skip_special_tokens=True)
                    if text != want or reply["usage"]["completion_tokens"] != NEW:
                        wrong[(method, name)] = (text, want)
    assert not wrong, wrong


def test_a_trained_method_without_its_drafter_is_refused_by_name_before_any_work(
        targets, tiny_dir, loads, questions, tmp_path, capsys, monkeypatch):
    """The tiny model has no shipped drafters: each door refuses the methods that need one,
    naming the drafter it needs, before the target runs a single forward (and before the bench
    starts a peer's process, which loads the target again)."""
    target = targets["float32"]
    forwards, peers = [], []
    monkeypatch.setattr(baselines, "PeerProcess", lambda *args: peers.append(args))
    hook = target.model.register_forward_hook(lambda *_: forwards.append(1))
    model = ["--model", str(tiny_dir)]
    try:
        for method in TRAINED:
            needed = METHODS[method].trained_kind
            with pytest.raises(VerispecError, match=needed):
                verispec.generate(target, PROMPT, chat=True, method=method, max_new_tokens=NEW)
            for argv in (["generate", *model, "--method", method, "--prompt", PROMPT],
                         ["bench", *model, "--methods", method, "--questions", str(questions),
                          "--out", str(tmp_path)],
                         ["serve", *model, "--method", method, "--port", "1"]):
                assert main(argv) == 2, (method, argv[0])
                err = capsys.readouterr().err
                assert err.startswith("verispec: error: ") and needed in err, (method, argv[0], err)
    finally:
        hook.remove()
    assert not forwards and not peers
