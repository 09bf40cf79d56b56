"""`verispec bench`: methods against baselines on the same questions, one run each (--repeats N:
the median of N).

Contenders run interleaved question by question (the order rotates), so machine drift hits all
of them alike. The default methods are the registry's bench set that the model can run, each
beside its Hugging Face peer; under greedy decoding every output is compared token for token
with verispec's `ar` output.
"""

from __future__ import annotations

import itertools
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, replace
from pathlib import Path

import torch
from tqdm import tqdm

from verispec import methods as registry
from verispec.bench.baselines import BASELINES
from verispec.bench.contender import BenchConfig, Contender, Outcome, exit_layer, trained_drafters
from verispec.bench.machine import PeakResident, machine_info, measure_forward
from verispec.bench.peer_process import PeerCrashed
from verispec.bench.questions import Question, load_questions
from verispec.bench.records import AR, HF, FirstDifference, Results, Run
from verispec.bench.report import write_results
from verispec.core.cores import OthersLoad
from verispec.core.errors import VerispecError
from verispec.core.tree import TreeSettings
from verispec.core.types import SamplingParams
from verispec.decoding.beam import check_drafter
from verispec.decoding.engine import SpeculativeEngine
from verispec.drafters.learned import shipped_drafter
from verispec.drafters.self_spec import SelfSettings
from verispec.drafters.self_spec import check as check_self
from verispec.drafters.suffix import add_outputs, forget_outputs, outputs_mark, take_outputs_since
from verispec.methods import Method, Needs, engine_for_checked, resolve_tree
from verispec.model.cached_model import CachedModel
from verispec.model.loading import LoadedModel, load_model
from verispec.options import DEFAULT_TREE, DraftOptions
from verispec.profile import CROWDED
from verispec.request import Request, build_request, encode_prompt, run


def can_run(target: LoadedModel, config: BenchConfig) -> Callable[[Method], bool]:
    """Whether `target` can run a method, by what the method needs: a trained drafter of its kind
    (given with --trained, or shipped), the lean CPU path (self-speculation), a draft model
    (--draft, or a distilled student)."""
    given = trained_drafters(config)
    try:
        check_self(target, SelfSettings())
        lean = True
    except VerispecError:
        lean = False

    def trained(kind: str | None) -> bool:
        return kind in given or (kind is not None and shipped_drafter(target.model, kind) is not None)

    def check(method: Method) -> bool:
        if method.needs is Needs.SELF:
            return lean
        if method.needs is Needs.TRAINED:
            return trained(method.trained_kind)
        if method.needs is Needs.DRAFT_MODEL:
            return bool(config.draft) or trained(method.trained_kind)
        return True

    return check


def choose_methods(config: BenchConfig, runnable: Callable[[Method], bool] = lambda method: True
                   ) -> list[str]:
    """hf and ar first, then the requested methods, or else every method of the registry's bench
    set that is `runnable`, each after its Hugging Face peer; validated."""
    methods = registry.METHODS
    has_draft = bool(config.draft)
    if config.methods is None:
        chosen = []
        for method in methods.values():
            if method.bench and method.name != AR and runnable(method):
                if method.hf_peer and (has_draft or not BASELINES[method.hf_peer].needs_draft):
                    chosen.append(method.hf_peer)
                chosen.append(method.name)
    else:
        known = set(methods) | set(BASELINES)
        unknown = [m for m in config.methods if m not in known]
        if unknown:
            raise VerispecError(f"unknown method(s) {', '.join(unknown)}; choose from "
                                f"{', '.join(sorted(known))}")
        chosen = list(config.methods)
    missing_draft = [m for m in chosen if (m in BASELINES and BASELINES[m].needs_draft and not has_draft)
                     or (m in methods and methods[m].needs is Needs.DRAFT_MODEL and not runnable(methods[m]))]
    if missing_draft:
        raise VerispecError(f"{', '.join(missing_draft)} need a draft model: pass --draft PATH")
    return [HF, AR] + [m for m in dict.fromkeys(chosen) if m not in (HF, AR)]


def method_options(method: str, k: int | None, target: LoadedModel, draft: LoadedModel | None,
                   config: BenchConfig, tree: TreeSettings | None = None,
                   acceptance: str = "exact") -> DraftOptions:
    """The drafting options a method runs with in the bench (`contender_request` checks them): its
    k, tree and acceptance, the given draft model or trained drafter, and the bench's other
    drafting options."""
    spec = registry.METHODS[method]
    trained = trained_drafters(config).get(spec.trained_kind)
    given = draft if spec.needs is Needs.DRAFT_MODEL and draft is not None else trained
    return replace(config.options, k=k, draft=given, exit_layer=exit_layer(target, config), tree=tree,
                   acceptance=acceptance)


def beam_refusal(engine: SpeculativeEngine) -> str | None:
    """Why the engine's drafter cannot draft for beam search (verispec.decoding.beam.check_drafter, as
    verispec.generate(num_beams=B) checks it); None: it can."""
    try:
        check_drafter(engine.drafter)
    except VerispecError as error:
        return str(error)
    return None


def contender_request(config: BenchConfig, target: LoadedModel, method: str, options: DraftOptions,
                      sampling: SamplingParams, prompts: list[list[int]]) -> Request:
    """The request a method runs in the bench, built and checked once per run (the method resolved
    with its options) with every question's prompt; each question runs it on its own prompt."""
    return build_request(target, prompts, method=method, options=options, sampling=sampling,
                         max_new_tokens=config.max_new_tokens, seed=config.seed,
                         **({} if config.beams is None else {
                             "num_beams": config.beams.num_beams,
                             "length_penalty": config.beams.length_penalty,
                             "early_stopping": config.beams.early_stopping}))


def verispec_contender(engine: SpeculativeEngine, target: LoadedModel, request: Request, label: str,
                       config: BenchConfig) -> Contender:
    """A method as the bench times it: each question `request` (contender_request's) run on its
    prompt on `engine`, built for the method (as verispec.generate runs it; with --num-beams its
    beam search, timed on the best sequence)."""
    def generate(prompt_ids: list[int]) -> Outcome:
        one = replace(request, prompts=[prompt_ids], batched=False)  # one of its prompts: checked
        started = time.perf_counter()
        result = run(target, one, engine)
        seconds = time.perf_counter() - started
        if config.beams is not None:
            return Outcome(result.token_ids, seconds, result.stats.target_forwards,
                           search_steps=result.stats.steps)
        return Outcome(result.token_ids, seconds, result.stats.target_forwards, result.stats)

    drafter, method, options = engine.drafter, request.method, request.options
    tree = None if drafter is None else drafter.tree  # --tree's, or the one the profile chose (eagle)
    k = None if method == AR else registry.METHODS[method].default_k if options.k is None else options.k
    return Contender(label, method, k, generate,
                     None if tree is None else f"{tree.topk}x{tree.nodes}",
                     None if drafter is None else drafter.describe(),
                     None if drafter is None or drafter.nbytes is None else drafter.nbytes / 2**20,
                     baseline=method == AR)


def build_contenders(config: BenchConfig, target: LoadedModel, draft: LoadedModel | None,
                     sampling: SamplingParams, prompts: list[list[int]]
                     ) -> tuple[list[Contender], dict[str, str]]:
    """The contenders for the questions' `prompts`, and those left out with why: a Hugging Face
    baseline that cannot run the target and draft (another baseline runs them instead:
    hf-assisted and hf-uag, by whether the draft shares the target's tokenizer), and with
    --num-beams the methods that cannot run beam search. Named in --methods, either is an error
    (beam search's all named in one); the default set leaves them out."""
    contenders, unfit, refused, methods = [], {}, {}, []
    for method in choose_methods(config, can_run(target, config)):
        baseline = BASELINES.get(method)
        why = None if baseline is None else baseline.unfit(target, draft)
        if why is None:
            methods.append(method)
            continue
        if config.methods is not None:
            raise VerispecError(f"{method} cannot run {target.name} with draft {draft.name}: {why}")
        unfit[method] = why
        methods.append(baseline.instead)
    peers: dict[int, str] = {}  # a peer's place among the contenders: started once all are checked
    for method in dict.fromkeys(methods):
        if method in BASELINES:
            baseline = BASELINES[method]
            if config.beams is not None and baseline.beam_refusal is not None:
                refused[method] = baseline.beam_refusal
            else:
                peers[len(contenders) + len(peers)] = method
            continue
        spec = registry.METHODS[method]
        ks = config.ks if config.ks and method != AR else [None]  # None: as the method runs by default
        trees: list[TreeSettings | None] = [None]
        if spec.trees:  # 'default' stands for the method's tree, where it has one
            trees += [resolve_tree(method, tree) for tree in config.trees or []
                      if tree != DEFAULT_TREE or spec.default_tree is not None]
            trees = list(dict.fromkeys(trees))
        rules = ["exact", "typical"] if config.typical and method != AR else ["exact"]  # typical: lossy
        for k, tree, rule in itertools.product(ks, trees, rules):
            label = " ".join([method] + ([f"k={k}"] if len(ks) > 1 else [])
                             + ([f"tree={tree.topk}x{tree.nodes}"] if tree else [])
                             + (["typical"] if rule == "typical" else []))
            request = contender_request(config, target, method,
                                        method_options(method, k, target, draft, config, tree, rule),
                                        sampling, prompts)
            engine = engine_for_checked(target, method, request.options)
            reason = None if config.beams is None else beam_refusal(engine)
            if reason is not None:
                refused[method] = reason
                break
            contenders.append(verispec_contender(engine, target, request, label, config))
    if refused and config.methods is not None:
        raise VerispecError(f"--num-beams {config.beams.num_beams}: cannot run beam search: "
                            + "; ".join(f"{name} ({why})" for name, why in refused.items())
                            + ". Leave them out of --methods")
    # a peer's child process loads the target (seconds): only once every method and every peer is
    # known to run (a peer that refuses this target, llama.cpp without a GGUF file, says so first)
    jobs = {place: BASELINES[method].prepare(method, target, draft, config, sampling)
            for place, method in peers.items()}
    for place, method in peers.items():
        contenders.insert(place, BASELINES[method].start(method, jobs[place]))
    return contenders, unfit | {name: f"cannot run beam search: {why}" for name, why in refused.items()}


def parting(ours: list[int], baseline: list[int]) -> FirstDifference | None:
    """Where two outputs part (None: they are equal), without the logit gap: how beam search's
    outputs are compared (its choices rest on summed log-probs, not one token's logits)."""
    position = next((i for i, (a, b) in enumerate(zip(ours, baseline)) if a != b), None)
    if position is None and len(ours) == len(baseline):
        return None
    if position is None:
        position = min(len(ours), len(baseline))
    return FirstDifference(position, ours[position] if position < len(ours) else None,
                           baseline[position] if position < len(baseline) else None)


def first_difference(target: LoadedModel, prompt_ids: list[int], ours: list[int],
                     baseline: list[int]) -> FirstDifference | None:
    """Where two outputs part, and the target's logit gap between the two tokens there."""
    found = parting(ours, baseline)
    if found is None or found.ours is None or found.baseline is None:
        return found
    position = found.position
    with torch.inference_mode():
        ids = torch.tensor([prompt_ids + baseline[:position]], device=target.model.device)
        logits = target.model(input_ids=ids).logits[0, -1].float()
    gap = float(logits[baseline[position]] - logits[ours[position]])
    return replace(found, logit_gap=gap, baseline_logit=float(logits[baseline[position]]))


def run_record(contender: Contender, question: Question, outcome: Outcome) -> Run:
    stats = outcome.stats
    counts = {} if stats is None else {
        "drafted_by_position": tuple(stats.drafted_by_position),
        "accepted_by_position": tuple(stats.accepted_by_position),
        "reached_by_position": tuple(stats.reached_by_position),
        "draft_seconds": stats.draft_seconds, "verify_seconds": stats.verify_seconds,
        "foreign_tokens": stats.foreign_tokens, "boundary_lost": stats.boundary_lost,
        "choices": tuple(stats.choices)}
    return Run(method=contender.method, label=contender.label, task=question.task,
               question_id=question.question_id, k=contender.k, new_tokens=len(outcome.tokens),
               seconds=outcome.seconds, target_forwards=outcome.target_forwards, tree=contender.tree,
               baseline=contender.baseline, peer=contender.peer, peak_rss_mib=outcome.peak_rss_mib,
               search_steps=outcome.search_steps, **counts)


def check_beams(config: BenchConfig) -> None:
    """With --num-beams: refuse what beam search does not take (sampling, trees, acceptance rules:
    it keeps exactly plain beam search's beams, greedy)."""
    if config.beams is None:
        return
    flags = {"--temperature > 0": config.temperature > 0, "--typical": config.typical,
             "--tree": bool(config.trees or config.options.tree),
             f"--acceptance {config.options.acceptance}": config.options.acceptance != "exact"}
    given = [flag for flag, set_ in flags.items() if set_]
    if given:
        raise VerispecError(f"--num-beams {config.beams.num_beams}: beam search is greedy over chains of "
                            f"drafts and keeps exactly plain beam search's beams; it takes no "
                            f"{', '.join(given)}")


def check_config(config: BenchConfig) -> None:
    """Refuse a bad configuration before anything is loaded."""
    choose_methods(config)  # the names
    if config.typical and config.temperature <= 0:
        raise VerispecError("--typical compares typical acceptance under sampling: give "
                            "--temperature > 0 (under greedy decoding it is plain greedy)")
    trained_drafters(config)
    if any(k < 0 for k in config.ks or []):
        raise VerispecError(f"--k values must be >= 0, got {config.ks}")
    if config.warmup < 0:
        raise VerispecError(f"--warmup must be >= 0, got {config.warmup}")
    if config.repeats < 1:
        raise VerispecError(f"--repeats must be >= 1, got {config.repeats}")
    check_beams(config)


def encode_questions(target: LoadedModel, questions: list[Question], max_new_tokens: int
                     ) -> dict[Question, list[int]]:
    """Each question's prompt ids (through the chat template where the model has one); a question
    too long for the model's context is refused by its id."""
    chat = target.has_chat_template
    prompts = {q: encode_prompt(target, q.prompt, chat=chat) for q in questions}
    for q, ids in prompts.items():
        if len(ids) + max_new_tokens > target.context_length:
            raise VerispecError(f"question {q.question_id} is too long for the model's context")
    return prompts


def attempt(contender: Contender, prompt_ids: list[int], where: str,
            crashed: dict[str, str]) -> Outcome | None:
    """The contender's outcome; None once its child process has crashed (recorded in `crashed`,
    label -> how and where; its earlier runs stand, the other rows go on)."""
    if contender.label in crashed:
        return None
    try:
        return contender.generate(prompt_ids)
    except PeerCrashed as crash:
        crashed[contender.label] = f"crashed ({crash.why}) {where}"
        print(f"verispec bench: {contender.label} {crashed[contender.label]}; the other rows go on",
              file=sys.stderr)
        return None


def start_results(config: BenchConfig, target: LoadedModel, contenders: list[Contender],
                  left_out: dict[str, str], questions: list[Question], crashed: dict[str, str]) -> Results:
    """The results before any run: the configuration, what runs and what was left out, the
    target's path, and the machine."""
    return Results(
        config={**{k: str(v) if isinstance(v, Path) else v for k, v in asdict(config).items()},
                "methods": list(dict.fromkeys(c.method for c in contenders)),
                "labels": [c.label for c in contenders],
                "drafters": {c.label: {"runs": c.drafter, "weights_mib": c.weights_mib}
                             for c in contenders if c.drafter is not None},
                "questions": str(config.questions or "built-in"),
                "num_questions": len(questions), "interrupted": False, "left_out": left_out,
                "crashed": crashed,
                **{name: value for name, value in asdict(CachedModel(target.model).stats()).items()
                   if name in ("invariance", "dtype", "kernel", "path")}},
        machine=machine_info(config.device))


def median_run(outcomes: list[Outcome]) -> Outcome:
    """The outcome of median seconds (the lower middle one of an even count: a run that was
    measured, not an average of two; its tokens are the ones compared)."""
    return sorted(outcomes, key=lambda outcome: outcome.seconds)[(len(outcomes) - 1) // 2]


def run_question(question: Question, prompt_ids: list[int], contenders: list[Contender], first: int,
                 target: LoadedModel, config: BenchConfig, reference: str | None, bar: tqdm,
                 crashed: dict[str, str]) -> list[Run]:
    """Every contender on one question, config.repeats rounds, each round starting one contender
    further on from contenders[first] (the order rotates), its record (with repeats, the run of
    median seconds, and every run's seconds); each output compared token for token with the
    contender labelled `reference`'s (None: none, under sampling). Every run drafts from the
    same earlier outputs: what a run adds to the suffix caches is held back until the question's
    last round ends (a repeated round, or the same method at another k, which shares its cache,
    would draft this question's answer back). A contender whose child process crashed has no
    record."""
    rounds: dict[Contender, list[Outcome]] = {}
    where = f"on {question.task} #{question.question_id}"
    for repeat in range(config.repeats):
        turn = (first + repeat) % len(contenders)
        answers: list[dict[str, list[list[int]]]] = []  # what each run added to the suffix caches
        for contender in contenders[turn:] + contenders[:turn]:
            bar.set_postfix_str(f"{question.task} #{question.question_id} {contender.label}")
            marks = outputs_mark(target.model)
            with PeakResident() as memory:
                outcome = attempt(contender, prompt_ids, where, crashed)
            answers.append(take_outputs_since(target.model, marks))
            if outcome is not None:  # a baseline's child process measured its own peak
                outcome.peak_rss_mib = outcome.peak_rss_mib or memory.peak
                rounds.setdefault(contender, []).append(outcome)
            bar.update()
    for added in answers:  # the last round's answers feed the next questions' drafts
        add_outputs(target.model, added)
    outputs = {contender: median_run(runs) for contender, runs in rounds.items()}
    baseline = next((o.tokens for c, o in outputs.items() if c.label == reference), None)
    records = []
    for contender in (c for c in contenders if c in outputs):  # records in a stable order
        record = run_record(contender, question, outputs[contender])
        if config.repeats > 1:
            record = replace(record, repeat_seconds=tuple(o.seconds for o in rounds[contender]))
        if baseline is not None and contender.label != reference:
            tokens = outputs[contender].tokens
            difference = (parting(tokens, baseline) if config.beams is not None
                          else first_difference(target, prompt_ids, tokens, baseline))
            record = replace(record, identical_to_baseline=tokens == baseline, first_difference=difference)
        records.append(record)
    return records


def note_others(results: Results, others: OthersLoad) -> None:
    """Keep what other processes took of the cores during the timed runs (results.json), and say
    so where it was enough to slow them (stderr, report.md): those timings are not this
    machine's alone."""
    results.config["others_busy_cores"] = None if others.cores is None else round(others.cores, 2)
    results.config["cores"] = others.capacity
    if others.took(torch.get_num_threads(), CROWDED):
        results.config["crowded"] = True
        print(f"verispec bench: other processes kept {others.cores:.1f} of {others.capacity:g} cores busy "
              "during the timed runs: its timings are not this machine's alone", file=sys.stderr)


def run_bench(config: BenchConfig, progress: bool = True) -> Results:
    """Run the benchmark; results.json is rewritten after every question, the report at the end.

    Ctrl-C stops early: what was measured so far is written, with config["interrupted"] = True.
    """
    sampling = SamplingParams.of(config.temperature, config.top_k, config.top_p)
    questions = load_questions(config.questions, config.tasks, config.limit_per_task)
    check_config(config)
    target = load_model(config.model, config.dtype, config.device)
    if target.tokenizer is None:
        raise VerispecError(f"{config.model} has no tokenizer: the benchmark needs text prompts")
    draft = load_model(config.draft, config.dtype, config.device) if config.draft else None
    prompts = encode_questions(target, questions, config.max_new_tokens)
    contenders, left_out = build_contenders(config, target, draft, sampling, list(prompts.values()))
    if left_out:
        print(f"verispec bench leaves out {', '.join(left_out)} (reasons in report.md)", file=sys.stderr)
    # Hugging Face's early-exit mode warns about its own internal arguments on every call.
    import transformers  # seconds to import: not for `verispec bench --help`

    transformers.utils.logging.set_verbosity_error()
    config.out.mkdir(parents=True, exist_ok=True)
    crashed: dict[str, str] = {}  # label -> how and where its child process died
    results = start_results(config, target, contenders, left_out, questions, crashed)
    first_prompt = prompts[questions[0]]
    bar = tqdm(total=(len(questions) * config.repeats + config.warmup) * len(contenders),
               desc="bench", unit="run", disable=not progress)
    try:
        for _ in range(config.warmup):
            for contender in contenders:
                bar.set_postfix_str(f"warm-up {contender.label}")
                attempt(contender, first_prompt, "in the warm-up", crashed)
                bar.update()
        # Timed after the warm-up: the first forwards after loading are slow. The warm-up's
        # outputs leave the suffix cache, or the first question would draft from its own answer.
        forget_outputs(target.model)
        with OthersLoad(children=True) as others:  # the peers' processes are the bench's own
            if config.beams is None:  # one path's forward costs: beam search's report does not use them
                depth300 = (first_prompt * (300 // len(first_prompt) + 1))[:300]
                results.forward = measure_forward(target, depth300)
            for index, question in enumerate(questions):
                results.runs += run_question(question, prompts[question], contenders, index % len(contenders),
                                             target, config, results.reference if sampling.greedy else None,
                                             bar, crashed)
                write_results(results, config.out, report=False)
        note_others(results, others)
    except KeyboardInterrupt:
        results.config["interrupted"] = True
    finally:
        bar.close()
        for contender in contenders:
            if contender.close is not None:
                contender.close()
    write_results(results, config.out, report=True)
    return results
