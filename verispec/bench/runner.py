"""`verispec bench`: every method against Hugging Face `generate()` on the same prompts, one run.

Methods run interleaved question by question (the order rotates), so machine drift hits all of
them alike. Hugging Face baselines: `hf` (plain generate), `hf-pld` (prompt_lookup_num_tokens),
`hf-assisted` (the same draft model as `draft`), `hf-early-exit` (assistant_early_exit).
Under greedy decoding every output is compared token for token with verispec's `ar` output.
"""

from __future__ import annotations

import itertools
import json
import os
import platform
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch
import transformers
from tqdm import tqdm

from verispec.api import encode_prompt
from verispec.bench.questions import Question, load_questions
from verispec.bench.report import summarize, theory, write_report
from verispec.cached_model import CachedModel
from verispec.drafters.early_exit import default_exit_layer
from verispec.drafters.learned import drafter_config, is_drafter_dir, shipped_drafter
from verispec.drafters.self_spec import SelfSettings
from verispec.drafters.self_spec import check as check_self
from verispec.engine import context_length
from verispec.errors import VerispecError
from verispec.methods import METHODS, TREE_METHODS, build_engine, resolve_tree
from verispec.models import LoadedModel, load_model
from verispec.options import DEFAULT_TREE, DraftOptions
from verispec.packed import packed_view
from verispec.stopping import StoppingRules
from verispec.tree import TreeSettings
from verispec.types import GenerationStats, SamplingParams

BASELINES = ("hf", "ar")
# Self-speculation methods in the default set (the other formats' staged variants: on request).
SELF_DEFAULTS = ("self-int4", "self-int8", "self-bf16", "self-int4-pld")
HF_METHODS = ("hf", "hf-pld", "hf-assisted", "hf-early-exit")
NEEDS_DRAFT = ("draft", "hf-assisted")
# Trained kinds run by default when the model has one; early-exit runs by default anyway (with its
# trained exit if there is one).
LEARNED = ("eagle", "medusa", "draft", "eagle3")


@dataclass(frozen=True)
class BenchConfig:
    model: str
    out: Path
    methods: list[str] | None = None  # None: baselines + every method available for the model
    ks: list[int] | None = None  # None: each method's default
    draft: str | None = None
    trained: list[str] | None = None  # trained drafter directories (eagle, medusa, early-exit)
    exit_layer: int | None = None
    questions: Path | None = None  # None: the built-in prompts
    tasks: list[str] | None = None
    limit_per_task: int | None = None
    max_new_tokens: int = 128
    temperature: float = 0.0
    seed: int = 0
    warmup: int = 1
    dtype: str = "float32"
    device: str = "cpu"
    # also run tree-capable methods with these trees (DEFAULT_TREE: each method's own)
    trees: list[TreeSettings | str] | None = None
    typical: bool = False  # also run each method with typical acceptance (lossy; sampling only)
    options: DraftOptions = DraftOptions()  # every other drafting setting, for every method


@dataclass
class Outcome:
    tokens: list[int]
    seconds: float
    target_forwards: int | None
    stats: GenerationStats | None = None
    peak_rss_mib: float | None = None  # the process's most resident memory during the run


@dataclass(frozen=True)
class Contender:
    label: str
    method: str
    k: int | None
    generate: Callable[[list[int]], Outcome] = field(compare=False)
    tree: str | None = None  # "TOPKxNODES" for a tree drafter
    drafter: str | None = None  # what the drafter runs, where it says (low-precision kernels...)
    weights_mib: float | None = None  # the drafter's own weights, where it reports them


def trained_drafters(config: BenchConfig) -> dict[str, str]:
    """--trained directories by drafter kind."""
    found: dict[str, str] = {}
    for path in config.trained or []:
        if not is_drafter_dir(path):
            raise VerispecError(f"--trained {path} is not a trained verispec drafter directory")
        kind = drafter_config(path)["kind"]
        if kind in found:
            raise VerispecError(f"--trained names two {kind} drafters: {found[kind]} and {path}")
        found[kind] = path
    return found


def choose_methods(config: BenchConfig, learned: list[str] = (), self_methods: list[str] = ()) -> list[str]:
    """Baselines first, then the requested (or every available) method, validated.

    learned: the trained-drafter methods available for the model (shipped or --trained);
    self_methods: the low-precision self-speculation methods the model can run.
    """
    known = set(METHODS) | set(HF_METHODS)
    if config.methods is None:
        methods = ["hf-pld", "pld", "hf-early-exit", "early-exit", "lookahead", *learned]
        if "eagle" in learned:
            methods.append("eagle-pld")
        methods += list(self_methods)
        if config.draft:
            methods += ["hf-assisted", "draft"]
        methods = list(dict.fromkeys(methods))
    else:
        unknown = [m for m in config.methods if m not in known]
        if unknown:
            raise VerispecError(f"unknown method(s) {', '.join(unknown)}; choose from "
                                f"{', '.join(sorted(known))}")
        methods = list(config.methods)
    missing_draft = [m for m in methods if m in NEEDS_DRAFT and not config.draft
                     and not (m == "draft" and "draft" in learned)]
    if missing_draft:
        raise VerispecError(f"{', '.join(missing_draft)} need a draft model: pass --draft PATH")
    return list(BASELINES) + [m for m in dict.fromkeys(methods) if m not in BASELINES]


def hf_contender(method: str, target: LoadedModel, draft: LoadedModel | None, config: BenchConfig,
                 sampling: SamplingParams, eos: list[int]) -> Contender:
    """Hugging Face generate() with the speculative mode that matches `method`, HF defaults otherwise."""
    extra: dict = {}
    if method == "hf-pld":
        extra = {"prompt_lookup_num_tokens": 10}
    elif method == "hf-assisted":
        extra = {"assistant_model": draft.model}
    elif method == "hf-early-exit":
        extra = {"assistant_early_exit": exit_layer(target, config)}
    k = extra.get("prompt_lookup_num_tokens")
    model = target.model
    settings = {"max_new_tokens": config.max_new_tokens, "do_sample": not sampling.greedy,
                "eos_token_id": eos, "pad_token_id": eos[0] if eos else 0, **extra}
    if not sampling.greedy:  # the same warps as verispec: temperature only, no top-k / top-p
        settings |= {"temperature": sampling.temperature, "top_k": 0, "top_p": 1.0}

    def generate(prompt_ids: list[int]) -> Outcome:
        calls = [0]
        # Counting target forwards is exact except in early exit, where the drafter is the target.
        hook = model.register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
        inputs = torch.tensor([prompt_ids], device=model.device)
        torch.manual_seed(config.seed)
        try:
            started = time.perf_counter()
            output = model.generate(inputs, **settings)
            tokens = output[0, len(prompt_ids):].tolist()
            seconds = time.perf_counter() - started
        finally:
            hook.remove()
        return Outcome(tokens, seconds, None if method == "hf-early-exit" else calls[0])

    return Contender(method, method, k, generate)


def available_self_methods(target: LoadedModel) -> list[str]:
    """The self-speculation methods `target` can run (none for models off the lean CPU path)."""
    try:
        check_self(target, SelfSettings())
    except VerispecError:
        return []
    return list(SELF_DEFAULTS)


def exit_layer(target: LoadedModel, config: BenchConfig) -> int:
    """The layer both early-exit methods use, so verispec and HF are compared like for like."""
    return default_exit_layer(target.model) if config.exit_layer is None else config.exit_layer


def verispec_contender(method: str, k: int | None, label: str, target: LoadedModel,
                       draft: LoadedModel | None, config: BenchConfig, sampling: SamplingParams,
                       stopping: StoppingRules, tree: TreeSettings | None = None,
                       acceptance: str = "exact") -> Contender:
    trained = trained_drafters(config).get(METHODS[method].trained_kind)
    options = replace(config.options, k=k,
                      draft=draft if method == "draft" and draft is not None else trained,
                      exit_layer=exit_layer(target, config), tree=tree, acceptance=acceptance)
    engine = build_engine(target, method, options)
    describe = getattr(engine.drafter, "describe", None)
    nbytes = getattr(engine.drafter, "nbytes", None)

    def generate(prompt_ids: list[int]) -> Outcome:
        started = time.perf_counter()
        result = engine.generate(prompt_ids, stopping, sampling, config.seed)
        seconds = time.perf_counter() - started
        return Outcome(result.token_ids, seconds, result.stats.target_forwards, result.stats)

    return Contender(label, method, k if method != "ar" else None, generate,
                     None if tree is None else f"{tree.topk}x{tree.nodes}",
                     describe() if describe else None, None if nbytes is None else nbytes / 2**20)


def build_contenders(config: BenchConfig, target: LoadedModel, draft: LoadedModel | None,
                     sampling: SamplingParams, stopping: StoppingRules) -> list[Contender]:
    eos = sorted(target.eos_token_ids)
    contenders = []
    given = trained_drafters(config)
    learned = [kind for kind in LEARNED
               if kind in given or shipped_drafter(target.model, kind) is not None]
    for method in choose_methods(config, learned, available_self_methods(target)):
        if method in HF_METHODS:
            contenders.append(hf_contender(method, target, draft, config, sampling, eos))
            continue
        ks = [None] if method == "ar" else (config.ks or [METHODS[method].default_k])
        trees: list[TreeSettings | None] = [None]
        if method in TREE_METHODS:  # 'default' stands for the method's tree, where it has one
            trees += [resolve_tree(method, tree) for tree in config.trees or []
                      if tree != DEFAULT_TREE or METHODS[method].default_tree is not None]
            trees = list(dict.fromkeys(trees))
        rules = ["exact", "typical"] if config.typical and method != "ar" else ["exact"]  # typical: lossy
        for k, tree, rule in itertools.product(ks, trees, rules):
            label = " ".join([method] + ([f"k={k}"] if len(ks) > 1 else [])
                             + ([f"tree={tree.topk}x{tree.nodes}"] if tree else [])
                             + (["typical"] if rule == "typical" else []))
            contenders.append(verispec_contender(method, k, label, target, draft, config, sampling,
                                                 stopping, tree, rule))
    return contenders


def measure_forward(target: LoadedModel, context: list[int], sizes=(1, 2, 4, 8, 16),
                    repeats: int = 7) -> dict:
    """Median time of one target forward over n new tokens with the context cached, as the engine
    runs it (prepacked weights where they apply) and, for comparison, through the model's own
    linear layers as Hugging Face generate() runs it. The two are timed in turn, forward by
    forward, so that the machine's drifts in speed fall on both alike."""
    variants = {"by_tokens": CachedModel(target.model, pack=True)}
    if packed_view(target.model) is not target.model:  # else both would be the same measurement
        variants["unpacked_by_tokens"] = CachedModel(target.model, pack=False)
    # which packed path ran (verispec.lean or verispec.packed)
    result = {"context_tokens": len(context), "lean": variants["by_tokens"].lean is not None}
    for lm in variants.values():
        lm.forward(torch.tensor(context, device=lm.device))
    times: dict[str, dict[int, list[float]]] = {key: {n: [] for n in sizes} for key in variants}
    generator = torch.Generator().manual_seed(0)
    for _ in range(repeats):
        for n in sizes:
            tokens = torch.randint(0, target.vocab_size, (n,), generator=generator)
            for key, lm in variants.items():
                started = time.perf_counter()
                lm.forward(tokens.to(lm.device))
                if lm.device.type == "cuda":
                    torch.cuda.synchronize()  # GPU work is asynchronous: time it to the end
                times[key][n].append(time.perf_counter() - started)
                lm.rewind(len(context))
    for key in variants:
        result[key] = {str(n): statistics.median(times[key][n]) for n in sizes}
    result["bare_forward_seconds"] = result["by_tokens"]["1"]
    return result


def first_difference(target: LoadedModel, prompt_ids: list[int], ours: list[int],
                     baseline: list[int]) -> dict | None:
    """Where two outputs part, and the target's logit gap between the two tokens there."""
    position = next((i for i, (a, b) in enumerate(zip(ours, baseline)) if a != b), None)
    if position is None:
        if len(ours) == len(baseline):
            return None
        position = min(len(ours), len(baseline))
        return {"position": position, "ours": ours[position] if position < len(ours) else None,
                "baseline": baseline[position] if position < len(baseline) else None,
                "logit_gap": None}
    with torch.inference_mode():
        ids = torch.tensor([prompt_ids + baseline[:position]], device=target.model.device)
        logits = target.model(input_ids=ids).logits[0, -1].float()
    gap = float(logits[baseline[position]] - logits[ours[position]])
    return {"position": position, "ours": ours[position], "baseline": baseline[position],
            "logit_gap": gap, "baseline_logit": float(logits[baseline[position]])}


# CPU features that decide which kernels are fast (bfloat16 and integer paths).
CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_int8")


def cpu_description() -> str:
    """The CPU's model name and its relevant flags, from /proc/cpuinfo (Linux), else the arch."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine()
    fields = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
    fields = {key.strip(): value.strip() for key, value in fields.items()}
    flags = set(fields.get("flags", "").split())
    have = [flag for flag in CPU_FLAGS if flag in flags]
    return f"{fields.get('model name', platform.machine())} ({', '.join(have) or 'no AVX2'})"


def resident_mib() -> float:
    """This process's resident memory now, in MiB (Linux; 0 elsewhere)."""
    try:
        pages = int(Path("/proc/self/statm").read_text().split()[1])
    except OSError:
        return 0.0
    return pages * os.sysconf("SC_PAGE_SIZE") / 2**20


class PeakResident:
    """The most resident memory seen while the block runs (a thread samples every 5 ms)."""

    def __enter__(self) -> PeakResident:
        self.peak = resident_mib()
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._done.wait(0.005):
            self.peak = max(self.peak, resident_mib())

    def __exit__(self, *exc) -> None:
        self._done.set()
        self._thread.join()
        self.peak = max(self.peak, resident_mib())


def machine_info(device: str) -> dict:
    info = {"platform": platform.platform(), "processor": cpu_description(),
            "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "python": platform.python_version(), "torch": torch.__version__,
            "transformers": transformers.__version__}
    if device.startswith("cuda") and torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


def run_record(contender: Contender, question: Question, outcome: Outcome) -> dict:
    stats = outcome.stats
    forwards = outcome.target_forwards
    return {
        "method": contender.method, "label": contender.label, "task": question.task,
        "question_id": question.question_id, "k": contender.k, "tree": contender.tree,
        "new_tokens": len(outcome.tokens), "seconds": outcome.seconds,
        "target_forwards": forwards,
        "mean_accepted_tokens": len(outcome.tokens) / forwards if forwards else None,
        "drafted_by_position": stats.drafted_by_position if stats else [],
        "accepted_by_position": stats.accepted_by_position if stats else [],
        "reached_by_position": stats.reached_by_position if stats else [],
        "draft_seconds": stats.draft_seconds if stats else None,
        "verify_seconds": stats.verify_seconds if stats else None,
        "identical_to_baseline": None, "first_difference": None,
        "peak_rss_mib": outcome.peak_rss_mib,
    }


def write_json(path: Path, data: dict) -> None:
    """Atomic write: a reader never sees half a file."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1))
    os.replace(tmp, path)


def run_bench(config: BenchConfig, progress: bool = True) -> dict:
    """Run the benchmark; results.json is rewritten after every question, the report at the end.

    Ctrl-C stops early: what was measured so far is written, with config["interrupted"] = True.
    """
    sampling = SamplingParams(do_sample=config.temperature > 0, temperature=config.temperature)
    questions = load_questions(config.questions, config.tasks, config.limit_per_task)
    choose_methods(config, LEARNED)  # validate names before loading anything
    if config.typical and config.temperature <= 0:
        raise VerispecError("--typical compares typical acceptance under sampling: give "
                            "--temperature > 0 (under greedy decoding it is plain greedy)")
    trained_drafters(config)
    if any(k < 0 for k in config.ks or []):
        raise VerispecError(f"--k values must be >= 0, got {config.ks}")
    if config.warmup < 0:
        raise VerispecError(f"--warmup must be >= 0, got {config.warmup}")
    target = load_model(config.model, config.dtype, config.device)
    if target.tokenizer is None:
        raise VerispecError(f"{config.model} has no tokenizer: the benchmark needs text prompts")
    draft = load_model(config.draft, config.dtype, config.device) if config.draft else None
    stopping = StoppingRules.build(config.max_new_tokens, target.eos_token_ids)
    contenders = build_contenders(config, target, draft, sampling, stopping)
    prompts = {q: encode_prompt(target, q.prompt, chat=bool(getattr(target.tokenizer, "chat_template",
                                                                   None)))
               for q in questions}
    for q, ids in prompts.items():
        if len(ids) + config.max_new_tokens > context_length(target.model):
            raise VerispecError(f"question {q.question_id} is too long for the model's context")

    # Hugging Face's early-exit mode warns about its own internal arguments on every call.
    transformers.utils.logging.set_verbosity_error()
    config.out.mkdir(parents=True, exist_ok=True)
    results = {"config": {**{k: str(v) if isinstance(v, Path) else v for k, v in asdict(config).items()},
                          "methods": list(dict.fromkeys(c.method for c in contenders)),
                          "labels": [c.label for c in contenders],
                          "drafters": {c.label: {"runs": c.drafter, "weights_mib": c.weights_mib}
                                       for c in contenders if c.drafter is not None},
                          "questions": str(config.questions or "built-in"),
                          "num_questions": len(questions), "interrupted": False,
                          "invariance": CachedModel(target.model).invariance},
               "machine": machine_info(config.device), "forward": {}, "runs": [],
               "summary": {}, "theory": {}}
    first_prompt = prompts[questions[0]]
    bar = tqdm(total=len(questions) * len(contenders) + config.warmup * len(contenders),
               desc="bench", unit="run", disable=not progress)
    try:
        for _ in range(config.warmup):
            for contender in contenders:
                bar.set_postfix_str(f"warm-up {contender.label}")
                contender.generate(first_prompt)
                bar.update()
        # Timed after the warm-up: the first forwards after loading are slow.
        results["forward"] = measure_forward(target, (first_prompt * (300 // len(first_prompt) + 1))[:300])
        for index, question in enumerate(questions):
            prompt_ids = prompts[question]
            order = contenders[index % len(contenders):] + contenders[:index % len(contenders)]
            outputs = {}
            for contender in order:
                bar.set_postfix_str(f"{question.task} #{question.question_id} {contender.label}")
                with PeakResident() as memory:
                    outputs[contender] = contender.generate(prompt_ids)
                outputs[contender].peak_rss_mib = memory.peak
                bar.update()
            baseline = next((o.tokens for c, o in outputs.items() if c.label == "ar"), None)
            for contender in contenders:  # records in a stable order
                record = run_record(contender, question, outputs[contender])
                if sampling.greedy and baseline is not None and contender.label != "ar":
                    tokens = outputs[contender].tokens
                    record["identical_to_baseline"] = tokens == baseline
                    record["first_difference"] = first_difference(target, prompt_ids, tokens, baseline)
                results["runs"].append(record)
            finish(results, config.out, report=False)
    except KeyboardInterrupt:
        results["config"]["interrupted"] = True
    finally:
        bar.close()
    finish(results, config.out, report=True)
    return results


def finish(results: dict, out: Path, report: bool) -> None:
    results["summary"] = summarize(results["runs"])
    results["theory"] = theory(results["runs"], results["forward"])
    write_json(out / "results.json", results)
    if report and results["runs"]:
        write_report(results, out)
