"""Speculation on bytes against tokens: every method that fits, on the byte model and on the
built-in token model, over the same held-out code and text prompts (docs/bytes.md).

Prompts: the beginnings of the standard-library files `verispec train bytes` holds out (raw
continuation, code) and held-out training-family prompts (chat, text); never Spec-Bench. Each
method runs on both models in turn, prompt by prompt, the order rotating so a drifting machine
load falls on all alike; every output must equal the same model's plain decoding (greedy). For
each model and method: tau (tokens per target forward), tokens/s and bytes/s of output (UTF-8
bytes of the text), and the speedup over the same model's plain decoding on the same prompts.

With --data (the answers directory of the training run) and --ablation (a byte model trained
with --heads 0, the same budget otherwise), also the held-out bits per byte of head 1 of each
byte model, and of the token model over the same documents.

    PYTHONPATH=$PWD python3 scripts/bytes_compare.py --data RUN/data --ablation ABLATION/model
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import sysconfig
import time
from pathlib import Path

import torch

from verispec.bench.machine import machine_info
from verispec.core.stopping import StoppingRules
from verispec.core.tree import TreeSettings
from verispec.core.types import SamplingParams
from verispec.decoding.sequence import SequenceSpec
from verispec.drafters.suffix import forget_outputs
from verispec.methods import build_engine
from verispec.model.loading import DEFAULT_MODEL, LoadedModel, load_model
from verispec.options import DraftOptions
from verispec.request import encode_prompt
from verispec.training.bytes import (
    ByteLM,
    ByteModelOptions,
    Corpus,
    held_out,
    held_out_bits,
    held_out_windows,
    stdlib_files,
)
from verispec.training.prompts import make_prompts

# method label -> (registered method, its options)
METHOD_SET = {
    "ar": ("ar", DraftOptions()),
    "mtp": ("mtp", DraftOptions()),
    "mtp tree 2x8": ("mtp", DraftOptions(tree=TreeSettings(2, 8))),
    "pld": ("pld", DraftOptions()),
    "pld tree": ("pld", DraftOptions(tree="default")),
    "suffix": ("suffix", DraftOptions()),
    "lookahead": ("lookahead", DraftOptions()),
    "self-int4-pld": ("self-int4-pld", DraftOptions()),
}


def code_prompts(count: int, size: int) -> list[str]:
    """The first lines (about `size` bytes) of held-out standard-library files, longest first."""
    root = Path(sysconfig.get_paths()["stdlib"])
    out = []
    for name in stdlib_files(root):
        if not held_out(name):
            continue
        text = (root / name).read_text(encoding="utf-8", errors="replace")
        cut = text.rfind("\n", 0, size)
        if cut > size // 2:
            out.append(text[: cut + 1])
    return out[:count]


def text_prompts(count: int, longest: int, writer_prompts: int, seed: int) -> list[str]:
    """Held-out training-family prompts (as `verispec train bytes` splits them) of at most
    `longest` characters."""
    return [p for p in make_prompts(writer_prompts, seed) if held_out(p) and len(p) <= longest][:count]


def run_all(models: dict[str, LoadedModel], prompts: dict[str, list[str]], methods: list[str],
            budgets: dict[str, int], sampling: SamplingParams = SamplingParams()) -> dict:
    """seconds, tokens, bytes and target forwards per (model, kind, method), summed over prompts.
    Greedy: every output must equal ar's. Sampled (seed = the prompt's index): outputs differ by
    method, so only tau and speed are compared (tests/test_bytes.py holds the law exact)."""
    totals: dict = collections.defaultdict(collections.Counter)
    engines = {(m, label): build_engine(models[m], *METHOD_SET[label]) for m in models for label in methods}
    for (m, _), engine in engines.items():  # warm-up
        engine.generate(
            SequenceSpec(encode_prompt(models[m], "def f(x):", chat=False), StoppingRules.build(16)))
    order = [(m, label) for label in methods for m in models]
    for kind, texts in prompts.items():
        for i, text in enumerate(texts):
            outputs = {}
            rotated = order[i % len(order):] + order[: i % len(order)]
            for m, label in rotated:
                target, engine = models[m], engines[(m, label)]
                ids = encode_prompt(target, text, chat=kind == "text")
                forget_outputs(target.model)  # suffix drafts from its own earlier outputs only
                rules = StoppingRules.build(budgets[m], target.eos_token_ids)
                started = time.perf_counter()
                result = engine.generate(SequenceSpec(ids, rules, sampling, seed=i))
                seconds = time.perf_counter() - started
                out = target.tokenizer.decode(result.token_ids, skip_special_tokens=True)
                row = totals[(m, kind, label)]
                row["seconds"] += seconds
                row["tokens"] += len(result.token_ids)
                row["bytes"] += len(out.encode())
                row["forwards"] += result.stats.target_forwards
                outputs[(m, label)] = result.token_ids
            for m in models if sampling.greedy else ():
                differing = [label for label in methods if outputs[(m, label)] != outputs[(m, "ar")]]
                if differing:
                    raise SystemExit(f"{m}, {kind} prompt {i}: {', '.join(differing)} differ from ar")
            print(f"{kind} prompt {i + 1}/{len(texts)} done", flush=True)
    return {f"{m}|{kind}|{label}": dict(row) for (m, kind, label), row in totals.items()}


def table(totals: dict, models: list[str], methods: list[str], kind: str) -> str:
    header = "| method | " + " | ".join(f"{m}: τ | tok/s | bytes/s | × ar" for m in models) + " |"
    lines = [header, "| :--- |" + " ---: | ---: | ---: | ---: |" * len(models)]
    for label in methods:
        cells = []
        for m in models:
            row, base = totals[f"{m}|{kind}|{label}"], totals[f"{m}|{kind}|ar"]
            cells.append(f"{row['tokens'] / row['forwards']:.2f} | {row['tokens'] / row['seconds']:.0f} | "
                         f"{row['bytes'] / row['seconds']:.0f} | {base['seconds'] / row['seconds']:.2f}")
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


@torch.no_grad()
def token_model_bits(target: LoadedModel, documents: list[str]) -> float:
    """The token model's bits per UTF-8 byte over documents (each read whole, from a BOS-free
    start: its first token is not scored)."""
    bits = nbytes = 0.0
    for text in documents:
        ids = torch.tensor([target.tokenizer(text, add_special_tokens=False)["input_ids"]])
        logits = target.model(ids).logits[0, :-1].float()
        bits += float(torch.nn.functional.cross_entropy(logits, ids[0, 1:], reduction="sum")) / math.log(2)
        first = target.tokenizer.decode(ids[0, :1])
        nbytes += len(text.encode()) - len(first.encode())
    return bits / nbytes


def quality(byte_models: dict[str, str], token_model: LoadedModel, data: str) -> dict:
    """Held-out bits per token of each byte model's head 1 on the training run's held-out
    windows (code and chat), and the token model's bits per byte over the same text."""
    corpus = Corpus.build(data)
    out = {}
    windows = None
    for label, path in byte_models.items():
        loaded = load_model(path)
        context = loaded.model.config.max_position_embeddings
        windows = held_out_windows(corpus, ByteModelOptions(context=context))
        out[label] = held_out_bits(ByteLM(loaded.model, None), windows)
    texts = collections.defaultdict(list)
    for w in windows:
        data_bytes = bytes(t for t in w.tokens.tolist() if t < 256)
        texts[w.kind].append(data_bytes.decode(errors="ignore"))
    out[token_model.name] = {f"bits_{kind}": token_model_bits(token_model, docs)
                             for kind, docs in texts.items()}
    return out


def plot_histories(histories: dict[str, Path], path: Path) -> dict:
    """Held-out bits per token (head 1: code and chat) against training hours, per run, drawn
    to path; returns the points."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    points = {}
    fig, axis = plt.subplots(figsize=(7, 4))
    for (label, file), colour in zip(histories.items(), ("C0", "C1", "C2")):
        evals = [h for h in json.loads(Path(file).read_text()) if "eval_bits_code" in h]
        hours = [h["seconds"] / 3600 for h in evals]
        points[label] = [{"step": h["step"], "hours": round(h["seconds"] / 3600, 3),
                          **{k: round(h[k], 4) for k in ("eval_bits_code", "eval_bits_chat")}}
                         for h in evals]
        for kind, style in (("code", "-"), ("chat", "--")):
            axis.plot(hours, [h[f"eval_bits_{kind}"] for h in evals], style, color=colour,
                      marker="o", markersize=3, label=f"{label}, {kind}")
    axis.set_xlabel("training hours (loaded 2-core CPU)")
    axis.set_ylabel("held-out bits per byte (next byte)")
    axis.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return points


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bytes", default="bytes", help="the byte model (default: the shipped one)")
    parser.add_argument("--tokens", default=DEFAULT_MODEL,
                        help="the token model ('': the byte model alone)")
    parser.add_argument("--prompts", type=int, default=6, help="prompts of each kind")
    parser.add_argument("--max-bytes", type=int, default=384, help="the byte model's budget")
    parser.add_argument("--max-tokens", type=int, default=96, help="the token model's budget")
    parser.add_argument("--methods", default=",".join(METHOD_SET))
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="sample at this temperature (0: greedy, outputs checked against ar); "
                        "an undertrained model's greedy output loops, which drafts flatter")
    parser.add_argument("--data", help="the byte model's training answers (for --ablation too)")
    parser.add_argument("--ablation", help="a byte model trained without extra heads")
    parser.add_argument("--out", help="write the figures as JSON here")
    parser.add_argument("--histories", nargs=2, metavar=("N8_RUN", "N1_RUN"),
                        help="the two training runs' run/history.json: draw held-out bits "
                        "against time into --plot, and stop")
    parser.add_argument("--plot", default="docs/img/bytes_training.png")
    args = parser.parse_args()
    if args.histories:
        points = plot_histories(dict(zip(("n = 8", "n = 1"), map(Path, args.histories))),
                                Path(args.plot))
        print(json.dumps(points, indent=1))
        return
    torch.set_num_threads(1)
    methods = args.methods.split(",")
    if args.data and not args.tokens:
        parser.error("--data compares bits per byte with the token model: give --tokens")
    models = {"bytes": load_model(args.bytes)}
    if args.tokens:
        models["tokens"] = load_model(args.tokens)
    writer = ByteModelOptions()
    prompts = {"code": code_prompts(args.prompts, 400),
               "text": text_prompts(args.prompts, 400, writer.prompts, 0)}
    totals = run_all(models, prompts, methods, {"bytes": args.max_bytes, "tokens": args.max_tokens},
                     SamplingParams.of(temperature=args.temperature))
    report = {"machine": machine_info("cpu"), "date": time.strftime("%Y-%m-%d"),
              "settings": vars(args), "totals": totals}
    for kind in prompts:
        print(f"\n{kind} prompts ({len(prompts[kind])}): bytes = {args.bytes}, tokens = {args.tokens}")
        print(table(totals, list(models), methods, kind))
    if args.data:
        byte_models = {"bytes (n = 8)": args.bytes}
        if args.ablation:
            byte_models["bytes (n = 1)"] = args.ablation
        report["quality"] = quality(byte_models, models["tokens"], args.data)
        print("\nheld-out bits per byte:", json.dumps(report["quality"], indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
