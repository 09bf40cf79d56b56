"""`verispec bench --batch-size 1,2,4,8,16`: throughput over all rows of a batch, per method.

Every contender decodes the same prompts in batches of each size: Hugging Face `generate()` on a
left-padded batch (`hf`), verispec's batched plain decoding (`ar`) and each speculative method
(one target pass per step for every row, each row with its own drafts). Prompts are taken from
the question list in order, wrapping around, so every batch is full and every contender gets the
same batches. Throughput is generated tokens (up to each row's EOS) over wall-clock seconds, all
batches of a size together. Under greedy decoding each row is compared with `ar`'s row; with a
temperature every contender samples (the same SamplingParams as everywhere, seeded), and the rows
are kept in batched.json beside the numbers.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from tqdm import tqdm

from verispec.bench.machine import machine_info
from verispec.bench.plots import plot_batched_throughput
from verispec.bench.questions import load_questions
from verispec.bench.records import AR, HF
from verispec.core.errors import VerispecError
from verispec.core.files import write_json
from verispec.core.policies import LoadCap
from verispec.core.tree import TreeSettings
from verispec.core.types import SamplingParams
from verispec.methods import BATCH_BENCH, METHODS, Needs, engine_for_checked, resolve, resolve_tree
from verispec.model.hf_generate import hf_generate_batch
from verispec.model.loading import LoadedModel, load_model
from verispec.options import DEFAULT_TREE, DraftOptions
from verispec.request import build_request, encode_prompt, run

BASELINES = (HF, AR)


@dataclass(frozen=True)
class BatchBenchConfig:
    model: str
    out: Path
    batch_sizes: list[int]
    # speculative methods (the baselines always run); None: BATCH_BENCH, and draft with a draft model
    methods: list[str] | None = None
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
    temperature: float = 0.0  # 0: greedy, every row compared with ar's
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1: off
    draft: str | None = None  # the draft model of the methods that need one (draft)
    # also run tree-capable methods with these trees (DEFAULT_TREE: each method's own)
    trees: list[TreeSettings | str] | None = None
    typical: bool = False  # also run each method with typical acceptance (lossy; sampling only)
    warmup: int = 1  # untimed batches of each contender first
    options: DraftOptions = DraftOptions()  # every other drafting setting, for every method

    @property
    def sampling(self) -> SamplingParams:
        return SamplingParams.of(self.temperature, self.top_k, self.top_p)

    @property
    def chosen(self) -> list[str]:
        """The speculative methods this run measures."""
        if self.methods is not None:
            return list(self.methods)
        return [*BATCH_BENCH, *(["draft"] if self.draft else [])]


# One contender: decodes a batch of prompts -> (each row's tokens, its row-forwards or None).
Decode = Callable[[list[list[int]]], tuple[list[list[int]], int | None]]


def hf_batched(target: LoadedModel, config: BatchBenchConfig) -> Decode:
    """Hugging Face generate() on a left-padded batch, greedy or sampled with the run's settings
    (seeded); rows cut after their first EOS."""
    def decode(prompts: list[list[int]]) -> tuple[list[list[int]], int | None]:
        return hf_generate_batch(target, prompts, config.max_new_tokens, config.sampling, config.seed), None

    return decode


def verispec_batched(target: LoadedModel, method: str, options: DraftOptions,
                     config: BatchBenchConfig) -> Decode:
    """A method decoding each batch as one Request (greedy or sampled, seeded), on one engine
    built for its options (checked by `resolve`)."""
    engine = engine_for_checked(target, method, options)
    if not config.load_cap:
        engine.load_cap = LoadCap(())

    def decode(prompts: list[list[int]]) -> tuple[list[list[int]], int | None]:
        request = build_request(target, prompts, method=method, options=options, sampling=config.sampling,
                                max_new_tokens=config.max_new_tokens, seed=config.seed)
        results = run(target, request, engine)
        # Row-forwards: each row's share of the target passes (tau is tokens per row-forward).
        return [r.token_ids for r in results], sum(r.stats.target_forwards for r in results)

    return decode


def check(config: BatchBenchConfig) -> None:
    """Refuse, by flag, what the run cannot honour, before anything loads."""
    if not config.batch_sizes or any(b < 1 for b in config.batch_sizes):
        raise VerispecError(f"--batch-size takes positive integers, got {config.batch_sizes}")
    unknown = [m for m in config.chosen if m not in METHODS]
    if unknown:
        raise VerispecError(f"unknown method(s) {', '.join(unknown)}; choose from {', '.join(METHODS)}")
    greedy = config.sampling.greedy  # a bad temperature, top-k or top-p fails here
    if config.typical and greedy:
        raise VerispecError("--typical compares typical acceptance under sampling: give "
                            "--temperature > 0 (under greedy decoding it is plain greedy)")
    if config.warmup < 0:
        raise VerispecError(f"--warmup must be >= 0, got {config.warmup}")
    if config.trees and not any(METHODS[m].trees for m in config.chosen):
        raise VerispecError(f"--tree: none of {', '.join(config.chosen)} drafts trees; add one that "
                            f"does to --methods ({', '.join(m for m in METHODS if METHODS[m].trees)})")
    if config.draft and not any(METHODS[m].needs is Needs.DRAFT_MODEL for m in config.chosen):
        raise VerispecError(f"--draft: none of {', '.join(config.chosen)} runs a draft model; add "
                            f"draft to --methods")


def contender_options(config: BatchBenchConfig, draft: LoadedModel | None
                      ) -> dict[str, tuple[str, DraftOptions]]:
    """label -> (method, its checked options): each method at each k, on its chain and on each
    --tree it drafts, with the run's acceptance rule and (--typical) typical acceptance too."""
    found: dict[str, tuple[str, DraftOptions]] = {}
    for method in [AR, *(m for m in config.chosen if m not in BASELINES)]:
        spec = METHODS[method]
        ks = [None] if method == AR else (config.ks or [None])
        trees: list[TreeSettings | None] = [None]
        if spec.trees:  # 'default' stands for the method's tree, where it has one
            trees += [resolve_tree(method, tree) for tree in config.trees or []
                      if tree != DEFAULT_TREE or spec.default_tree is not None]
        rules = ["exact"] if method == AR else list(dict.fromkeys(
            [config.options.acceptance, *(["typical"] if config.typical else [])]))
        for k, tree, rule in itertools.product(ks, dict.fromkeys(trees), rules):
            label = " ".join([method] + ([f"k={k}"] if len(ks) > 1 else [])
                             + ([f"tree={tree.topk}x{tree.nodes}"] if tree else [])
                             + ([rule] if rule != "exact" else []))
            given = draft if spec.needs is Needs.DRAFT_MODEL else None
            found[label] = (method, resolve(method, replace(config.options, k=k, tree=tree,
                                                            acceptance=rule, draft=given)))
    return found


def run_batched_bench(config: BatchBenchConfig, progress: bool = True) -> dict:
    """Measure every contender at every batch size; writes batched.json, batched.md, batched.png."""
    check(config)
    questions = load_questions(config.questions, config.tasks, config.limit_per_task)
    target = load_model(config.model, config.dtype, config.device)
    if target.tokenizer is None:
        raise VerispecError(f"{config.model} has no tokenizer: the benchmark needs text prompts")
    draft = load_model(config.draft, config.dtype, config.device) if config.draft else None
    chat = target.has_chat_template
    prompts = [encode_prompt(target, q.prompt, chat=chat) for q in questions]
    contenders: dict[str, Decode] = {HF: hf_batched(target, config)}
    for label, (method, options) in contender_options(config, draft).items():
        contenders[label] = verispec_batched(target, method, options, config)
    import transformers  # seconds to import: not for `verispec bench --help`

    transformers.utils.logging.set_verbosity_error()
    config.out.mkdir(parents=True, exist_ok=True)
    results = {"config": {**{key: str(v) if isinstance(v, Path) else v for key, v in asdict(config).items()},
                          "methods": config.chosen, "labels": list(contenders),
                          "num_prompts": len(prompts)},
               "machine": machine_info(config.device), "sizes": {}}
    runs = sum(-(-len(prompts) // size) for size in config.batch_sizes) * len(contenders)
    bar = tqdm(total=runs + config.warmup * len(contenders), desc="batched bench", unit="batch",
               disable=not progress)
    for _ in range(config.warmup):  # the first forwards after loading are slow
        for label, decode in contenders.items():
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
        results["sizes"][str(size)] = summarize_size(measured, config.sampling.greedy)
        write_json(config.out / "batched.json", results)
    bar.close()
    write_batched_report(results, config.out)
    return results


def summarize_size(measured: dict[str, dict], greedy: bool) -> dict:
    """Throughput, ratios to hf and ar, rows identical to ar's (greedy; None when sampled) and
    the rows themselves, per contender."""
    summary = {}
    rate = {label: m["tokens"] / m["seconds"] for label, m in measured.items()}
    reference = measured[AR]["rows"]
    for label, m in measured.items():
        same = sum(a == b for a, b in zip(m["rows"], reference))
        summary[label] = {"tokens": m["tokens"], "seconds": m["seconds"],
                          "tokens_per_second": rate[label],
                          "vs_hf": rate[label] / rate[HF], "vs_ar": rate[label] / rate[AR],
                          "tau": m["tokens"] / m["forwards"] if m["forwards"] else None,
                          "identical_to_ar": f"{same}/{len(reference)}" if greedy else None,
                          "rows": m["rows"]}
    return summary


def decoding_words(config: dict) -> str:
    """How the run decoded, for the report: greedy, or its sampling settings and seed."""
    if SamplingParams.of(config["temperature"], config["top_k"], config["top_p"]).greedy:
        return "greedy"
    return (f"sampled (temperature {config['temperature']}, top-k {config['top_k'] or 'off'}, "
            f"top-p {config['top_p']}, seed {config['seed']}; rows are not compared with ar's"
            + ("; typical acceptance is LOSSY" if config["typical"] else "") + ")")


def write_batched_report(results: dict, out: Path) -> Path:
    """batched.md (the table and how it was made) and batched.png (throughput vs batch size)."""
    sizes = list(results["sizes"])
    labels = results["config"]["labels"]
    lines = ["# Batched throughput", "",
             f"Model {results['config']['model']} ({results['config']['dtype']}), "
             f"{results['config']['num_prompts']} prompts, up to {results['config']['max_new_tokens']} new "
             f"tokens, {decoding_words(results['config'])}; {results['machine']['processor']}, "
             f"{results['machine'].get('usable_cores', results['machine']['cpu_count'])} cores.",
             "Generated tokens per second over all rows (× hf batched at the same size; τ for "
             "speculative methods; under greedy decoding, rows identical to ar).", "",
             "| method | " + " | ".join(f"batch {s}" for s in sizes) + " |",
             "|---|" + "---|" * len(sizes)]
    for label in labels:
        cells = []
        for size in sizes:
            s = results["sizes"][size][label]
            cell = f"{s['tokens_per_second']:.1f} ({s['vs_hf']:.2f}×)"
            if label not in BASELINES:
                cell += f" τ {s['tau']:.2f}" + (f", {s['identical_to_ar']}" if s["identical_to_ar"] else "")
            cells.append(cell)
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    (out / "batched.md").write_text("\n".join(lines) + "\n")
    return plot_batched_throughput(results, out / "batched.png")
