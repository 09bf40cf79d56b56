"""`verispec bench --batch-size 1,2,4,8,16`: throughput over all rows of a batch, per method.

Every contender decodes the same prompts in batches of each size: Hugging Face `generate()` on a
left-padded batch (`hf`), verispec's batched plain decoding (`ar`) and each speculative method
(one target pass per step for every row, each row with its own drafts). Prompts are taken from
the question list in order, wrapping around, so every batch is full and every contender gets the
same batches. Throughput is generated tokens (up to each row's EOS) over wall-clock seconds, all
batches of a size together. Under greedy decoding each row is compared with `ar`'s row.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import transformers
from tqdm import tqdm

from verispec.bench.machine import machine_info
from verispec.bench.plots import plot_batched_throughput
from verispec.bench.questions import load_questions
from verispec.bench.records import AR, HF, write_json
from verispec.core.errors import VerispecError
from verispec.core.policies import LoadCap
from verispec.methods import METHODS, engine_for_checked, resolve
from verispec.model.hf_generate import hf_generate_batch
from verispec.model.loading import LoadedModel, load_model
from verispec.options import DraftOptions
from verispec.request import build_request, encode_prompt, run

BASELINES = (HF, AR)


@dataclass(frozen=True)
class BatchBenchConfig:
    model: str
    out: Path
    batch_sizes: list[int]
    methods: list[str]  # speculative methods (the baselines always run)
    ks: list[int] | None = None  # None: each method's default
    questions: Path | None = None
    tasks: list[str] | None = None
    limit_per_task: int | None = None
    max_new_tokens: int = 128
    dtype: str = "float32"
    device: str = "cpu"
    seed: int = 0
    # Measure with the engine's draft-length cap by batch size (default) or without (to find it).
    load_cap: bool = True


# One contender: decodes a batch of prompts -> (each row's tokens, target forwards, new tokens).
Decode = Callable[[list[list[int]]], tuple[list[list[int]], int | None]]


def hf_batched(target: LoadedModel, config: BatchBenchConfig) -> Decode:
    """Hugging Face generate() on a left-padded batch, greedy; rows cut after their first EOS."""
    def decode(prompts: list[list[int]]) -> tuple[list[list[int]], int | None]:
        return hf_generate_batch(target, prompts, config.max_new_tokens), None

    return decode


def verispec_batched(target: LoadedModel, method: str, k: int | None, config: BatchBenchConfig) -> Decode:
    """A method decoding each batch as one Request (greedy), on one engine built for it."""
    options = resolve(method, DraftOptions(k=k))
    engine = engine_for_checked(target, method, options)
    if not config.load_cap:
        engine.load_cap = LoadCap(())

    def decode(prompts: list[list[int]]) -> tuple[list[list[int]], int | None]:
        request = build_request(target, prompts, method=method, options=options,
                                max_new_tokens=config.max_new_tokens, seed=config.seed)
        results = run(target, request, engine)
        # Row-forwards: each row's share of the target passes (tau is tokens per row-forward).
        return [r.token_ids for r in results], sum(r.stats.target_forwards for r in results)

    return decode


def run_batched_bench(config: BatchBenchConfig, progress: bool = True) -> dict:
    """Measure every contender at every batch size; writes batched.json, batched.md, batched.png."""
    if not config.batch_sizes or any(b < 1 for b in config.batch_sizes):
        raise VerispecError(f"--batch-size takes positive integers, got {config.batch_sizes}")
    unknown = [m for m in config.methods if m not in METHODS]
    if unknown:
        raise VerispecError(f"unknown method(s) {', '.join(unknown)}; choose from {', '.join(METHODS)}")
    questions = load_questions(config.questions, config.tasks, config.limit_per_task)
    target = load_model(config.model, config.dtype, config.device)
    if target.tokenizer is None:
        raise VerispecError(f"{config.model} has no tokenizer: the benchmark needs text prompts")
    chat = bool(getattr(target.tokenizer, "chat_template", None))
    prompts = [encode_prompt(target, q.prompt, chat=chat) for q in questions]
    contenders: dict[str, Decode] = {HF: hf_batched(target, config)}
    for method in [AR, *(m for m in config.methods if m not in BASELINES)]:
        for k in [None] if method == AR else (config.ks or [None]):
            label = method if k is None or not config.ks or len(config.ks) == 1 else f"{method} k={k}"
            contenders[label] = verispec_batched(target, method, k, config)
    transformers.utils.logging.set_verbosity_error()
    config.out.mkdir(parents=True, exist_ok=True)
    results = {"config": {**{key: str(v) if isinstance(v, Path) else v for key, v in asdict(config).items()},
                          "labels": list(contenders), "num_prompts": len(prompts)},
               "machine": machine_info(config.device), "sizes": {}}
    runs = sum(-(-len(prompts) // size) for size in config.batch_sizes) * len(contenders)
    bar = tqdm(total=runs + len(contenders), desc="batched bench", unit="batch", disable=not progress)
    for label, decode in contenders.items():  # warm-up: the first forwards after loading are slow
        bar.set_postfix_str(f"warm-up {label}")
        decode(prompts[:2])
        bar.update()
    for size in config.batch_sizes:
        batches = [[prompts[(start + i) % len(prompts)] for i in range(size)]
                   for start in range(0, len(prompts), size)]
        measured: dict[str, dict] = {label: {"tokens": 0, "seconds": 0.0, "forwards": 0, "rows": []}
                                     for label in contenders}
        for index, batch in enumerate(batches):
            order = list(contenders)
            order = order[index % len(order):] + order[:index % len(order)]  # drift hits all alike
            for label in order:
                bar.set_postfix_str(f"batch {size}: {label}")
                started = time.perf_counter()
                rows, forwards = contenders[label](batch)
                record = measured[label]
                record["seconds"] += time.perf_counter() - started
                record["tokens"] += sum(map(len, rows))
                record["forwards"] += forwards or 0
                record["rows"] += rows
                bar.update()
        results["sizes"][str(size)] = summarize_size(measured)
        write_json(config.out / "batched.json", results)
    bar.close()
    write_batched_report(results, config.out)
    return results


def summarize_size(measured: dict[str, dict]) -> dict:
    """Throughput, ratios to hf and ar, and rows identical to ar's, per contender."""
    summary = {}
    rate = {label: m["tokens"] / m["seconds"] for label, m in measured.items()}
    reference = measured[AR]["rows"]
    for label, m in measured.items():
        same = sum(a == b for a, b in zip(m["rows"], reference))
        summary[label] = {"tokens": m["tokens"], "seconds": m["seconds"],
                          "tokens_per_second": rate[label],
                          "vs_hf": rate[label] / rate[HF], "vs_ar": rate[label] / rate[AR],
                          "tau": m["tokens"] / m["forwards"] if m["forwards"] else None,
                          "identical_to_ar": f"{same}/{len(reference)}"}
    return summary


def write_batched_report(results: dict, out: Path) -> Path:
    """batched.md (the table and how it was made) and batched.png (throughput vs batch size)."""
    sizes = list(results["sizes"])
    labels = results["config"]["labels"]
    lines = ["# Batched throughput", "",
             f"Model {results['config']['model']} ({results['config']['dtype']}), "
             f"{results['config']['num_prompts']} prompts, up to {results['config']['max_new_tokens']} new "
             f"tokens, greedy; {results['machine']['processor']}, {results['machine']['cpu_count']} cores.",
             "Generated tokens per second over all rows (× hf batched at the same size; τ for "
             "speculative methods; rows identical to ar).", "",
             "| method | " + " | ".join(f"batch {s}" for s in sizes) + " |",
             "|---|" + "---|" * len(sizes)]
    for label in labels:
        cells = []
        for size in sizes:
            s = results["sizes"][size][label]
            cell = f"{s['tokens_per_second']:.1f} ({s['vs_hf']:.2f}×)"
            if label not in BASELINES:
                cell += f" τ {s['tau']:.2f}, {s['identical_to_ar']}"
            cells.append(cell)
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    (out / "batched.md").write_text("\n".join(lines) + "\n")
    return plot_batched_throughput(results, out / "batched.png")
