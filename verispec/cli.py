"""The `verispec` command: generate, demo, bench, train, export, serve."""

from __future__ import annotations

import argparse
import json
import os
import sys

from verispec.api import make_job, run
from verispec.display import LEGEND, acceptance_line, render_steps, render_tree, stats_table
from verispec.errors import VerispecError
from verispec.methods import FALLBACK, FASTEST, METHODS, TREE_METHODS, fastest_method
from verispec.models import BUILTIN_MODELS, DEFAULT_MODEL, DTYPES, load_model
from verispec.options import DEFAULT_TREE, DraftOptions, parse_tree
from verispec.policies import SCHEDULES
from verispec.tree import TreeSettings
from verispec.types import GenerationStats, SamplingParams
from verispec.verifiers import ACCEPTANCE

# Prompts whose answers reuse the prompt's words: where prompt lookup, the best drafter that needs
# no training, pays off.
DEMO_PROMPTS = [
    "Fix the typo in this Python function and return the whole corrected function:\n\n"
    "def average(values):\n    total = 0\n    for value in values:\n        total += value\n"
    "    return total / len(valuse)",
    "Use the passage to answer the question.\n\nPassage: The Karsten Bridge opened in 1931 and "
    "carries a two-lane road over the Vell river. It was designed by the engineer Marta Lind, who "
    "also designed the town's water tower. Its steel cables were replaced in 2015.\n\n"
    "Question: Who designed the Karsten Bridge, and what else did she design?",
    "Put this list in alphabetical order, one item per line: pears, apples, plums, figs, cherries, "
    "dates, bananas.",
]


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=DEFAULT_MODEL,
                        help=f"built-in name ({', '.join(BUILTIN_MODELS)}), a Hugging Face model "
                             f"directory or a .gguf file (default: {DEFAULT_MODEL})")
    parser.add_argument("--dtype", default="float32", choices=list(DTYPES),
                        help="weights and compute dtype; exactness is relative to this dtype")
    parser.add_argument("--device", default="cpu", help="cpu or cuda (default: cpu)")


def add_method_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--method", choices=list(METHODS),
                        help="; ".join(f"{m.name}: {m.description}" for m in METHODS.values())
                        + f" (default: {FASTEST}, the fastest measured here, where the model can "
                        f"run it; else {FALLBACK})")
    parser.add_argument("--draft", help="draft model for --method draft (name, directory or .gguf); "
                        "for eagle, medusa, hydra, mtp, early-exit: a trained drafter directory "
                        "(default: the one shipped for the model)")
    parser.add_argument("--k", type=int, help="tokens drafted per step (0: no drafting; default: "
                        + ", ".join(f"{m.name} {m.default_k}" for m in METHODS.values() if m.build)
                        + "); clamped to what fits")
    parser.add_argument("--schedule", default="constant", choices=list(SCHEDULES),
                        help="draft length: constant k, or heuristic (+2 after a full accept, -1 otherwise)")
    parser.add_argument("--confidence-threshold", type=float,
                        help="model drafters stop drafting when their confidence falls below this")
    parser.add_argument("--exit-layer", type=int, help="early exit: layers used to draft (default: half)")
    parser.add_argument("--max-ngram", type=int, default=DraftOptions.max_ngram,
                        help="prompt lookup: longest n-gram to match")
    parser.add_argument("--min-ngram", type=int, default=DraftOptions.min_ngram,
                        help="prompt lookup: shortest n-gram to match")
    parser.add_argument("--tree", type=tree_settings, metavar="TOPKxNODES", nargs="?",
                        const=DEFAULT_TREE,
                        help="draft a token tree of depth k instead of a chain (TOPKxNODES, e.g. "
                        "4x16: top-k children per expanded node, NODES draft nodes in all); alone: "
                        "the method's default tree, the fastest measured on a CPU ("
                        + ", ".join(f"{m.name} {m.default_tree.topk}x{m.default_tree.nodes}"
                                    for m in METHODS.values() if m.default_tree) + ")")
    parser.add_argument("--group", type=int, default=DraftOptions.group,
                        help="self-int4: input columns sharing one scale (32, 64 or 128; default 32)")
    parser.add_argument("--skip-layers", type=int_list, default=(), metavar="I,J,...",
                        help="self-*: decoder layers the low-precision drafter leaves out (default: none)")
    parser.add_argument("--lookahead-window", type=int, default=DraftOptions.lookahead_window,
                        metavar="W", help="lookahead: guesses in the Jacobi window per iteration "
                        f"(default {DraftOptions.lookahead_window})")
    parser.add_argument("--lookahead-ngram", type=int, metavar="N",
                        help="lookahead: n-gram size; the window keeps N - 1 iterations and drafts "
                        "min(k, N - 1) tokens per n-gram (default: k + 1)")
    parser.add_argument("--lookahead-guesses", type=int, default=DraftOptions.lookahead_guesses,
                        metavar="G", help="lookahead: n-grams kept and verified per first token "
                        f"(default {DraftOptions.lookahead_guesses})")
    parser.add_argument("--lookahead-pool-context", action=argparse.BooleanOptionalAction,
                        default=DraftOptions.lookahead_pool_context,
                        help="lookahead: also pool the n-grams of the prompt and output")
    parser.add_argument("--acceptance", default="exact", choices=list(ACCEPTANCE),
                        help="exact (default, lossless) or typical: Medusa's typical acceptance, "
                        "LOSSY under sampling (the output no longer follows the target's "
                        "distribution; under greedy decoding it is exact)")


def tree_settings(text: str) -> TreeSettings | str:
    """argparse's face of verispec.options.parse_tree."""
    try:
        return parse_tree(text)
    except VerispecError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def int_list(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(item) for item in comma_list(text))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected integers separated by commas, got {text!r}") from None


def tree_list(text: str) -> list[TreeSettings | str]:
    return [tree_settings(item) for item in comma_list(text)]


def draft_options(args: argparse.Namespace) -> DraftOptions:
    return DraftOptions(k=args.k, schedule=args.schedule, confidence_threshold=args.confidence_threshold,
                        draft=args.draft, exit_layer=args.exit_layer, max_ngram=args.max_ngram,
                        min_ngram=args.min_ngram, tree=args.tree, acceptance=args.acceptance,
                        group=args.group, skip_layers=args.skip_layers,
                        lookahead_window=args.lookahead_window, lookahead_ngram=args.lookahead_ngram,
                        lookahead_guesses=args.lookahead_guesses,
                        lookahead_pool_context=args.lookahead_pool_context)


def use_colour(choice: str) -> bool:
    if choice == "auto":
        return sys.stdout.isatty() and "NO_COLOR" not in os.environ
    return choice == "always"


def cmd_generate(args: argparse.Namespace) -> int:
    sampling = SamplingParams(do_sample=args.temperature > 0, temperature=args.temperature,
                              top_k=args.top_k, top_p=args.top_p)
    if not args.prompt.strip():
        raise VerispecError("the prompt is empty")
    target = load_model(args.model, args.dtype, args.device)
    args.method = args.method or fastest_method(target)
    job = make_job(target, args.prompt, method=args.method, options=draft_options(args),
                   sampling=sampling, max_new_tokens=args.max_new_tokens, stop_strings=args.stop,
                   chat=not args.raw, seed=args.seed)
    result = run(job)
    if args.json:
        print(json.dumps({"text": result.text, "token_ids": result.token_ids,
                          "stats": result.stats.as_dict()}))
        return 0
    colour = use_colour(args.color)
    if args.show_tree:
        for number, step in enumerate(result.steps, 1):
            if step.tree is not None:
                print(f"step {number}: {len(step.tree.tokens)} draft nodes, depth {step.tree.depth}, "
                      f"{len(step.tree.path)} accepted (marked *)")
                print(render_tree(step.tree, target.tokenizer) + "\n")
    print(render_steps(result.steps, target.tokenizer, colour))
    print()
    if colour and args.method != "ar":
        print(LEGEND)
    print(stats_table({args.method: result.stats}))
    if args.method != "ar":
        print(acceptance_line(result.stats))
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    target = load_model(args.model, args.dtype, args.device)
    args.method = args.method or fastest_method(target)
    colour = use_colour(args.color)
    totals: dict[str, list] = {"ar": [], args.method: []}
    for method in totals:  # warm-up: the first forward passes are slow; keep them out of timings
        run(make_job(target, DEMO_PROMPTS[0], method=method, options=draft_options(args),
                     max_new_tokens=4, chat=True))
    for prompt in DEMO_PROMPTS:
        print(f"\n>>> {prompt}")
        for method in totals:
            job = make_job(target, prompt, method=method, options=draft_options(args),
                           max_new_tokens=args.max_new_tokens, chat=True)
            totals[method].append(run(job))
        plain, fast = totals["ar"][-1], totals[args.method][-1]
        print(render_steps(fast.steps, target.tokenizer, colour))
        same = "identical to" if plain.token_ids == fast.token_ids else "DIFFERENT from"
        print(f"[{args.method}: {fast.stats.tokens_per_second:.1f} tok/s, tau "
              f"{fast.stats.mean_accepted_tokens:.2f}; ar: {plain.stats.tokens_per_second:.1f} tok/s; "
              f"output {same} plain decoding]")
    if colour:
        print("\n" + LEGEND)
    print()
    seconds = {m: sum(r.stats.total_seconds for r in rs) for m, rs in totals.items()}
    merged = {m: GenerationStats.total([r.stats for r in rs]) for m, rs in totals.items()}
    print(stats_table(merged))
    print(f"\nspeedup of {args.method} over plain decoding (same run, same prompts): "
          f"{seconds['ar'] / seconds[args.method]:.2f}x, tau {merged[args.method].mean_accepted_tokens:.2f}")
    return 0


def comma_list(text: str) -> list[str]:
    return [item.strip() for item in text.split(",") if item.strip()]


def comma_ints(text: str) -> list[int]:
    try:
        return [int(item) for item in comma_list(text)]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def cmd_bench(args: argparse.Namespace) -> int:
    from pathlib import Path

    from verispec.bench.report import compare
    from verispec.bench.runner import BenchConfig, run_bench

    if args.compare:
        loaded = []
        for path in args.compare:
            try:
                loaded.append(json.loads(Path(path).read_text()))
            except (OSError, ValueError) as error:
                raise VerispecError(f"cannot read results file {path}: {error}") from error
        print(compare(*loaded))
        return 0
    if args.batch_size:
        return bench_batched(args)
    config = BenchConfig(model=args.model, out=Path(args.out), methods=args.methods, ks=args.k,
                         draft=args.draft, trained=args.trained, exit_layer=args.exit_layer,
                         questions=Path(args.questions) if args.questions else None, tasks=args.tasks,
                         limit_per_task=args.limit_per_task, max_new_tokens=args.max_new_tokens,
                         temperature=args.temperature, seed=args.seed, warmup=args.warmup,
                         dtype=args.dtype, device=args.device, trees=args.trees,
                         typical=args.typical)
    results = run_bench(config)
    print((Path(args.out) / "report.md").read_text() if results["runs"] else "no runs finished")
    if results["config"]["interrupted"]:
        print(f"verispec: interrupted; results so far are in {args.out}", file=sys.stderr)
        return 130
    return 0


def bench_batched(args: argparse.Namespace) -> int:
    from pathlib import Path

    from verispec.bench.batched import BatchBenchConfig, run_batched_bench

    config = BatchBenchConfig(model=args.model, out=Path(args.out), batch_sizes=args.batch_size,
                              methods=args.methods or ["pld", "self-int4-pld", "eagle-pld"], ks=args.k,
                              questions=Path(args.questions) if args.questions else None,
                              tasks=args.tasks, limit_per_task=args.limit_per_task,
                              max_new_tokens=args.max_new_tokens, dtype=args.dtype, device=args.device,
                              seed=args.seed, load_cap=not args.no_load_cap)
    run_batched_bench(config)
    print((Path(args.out) / "batched.md").read_text())
    return 0


def cmd_train(args: argparse.Namespace) -> int:
    from pathlib import Path

    from verispec.training.data import (
        build_dataset,
        build_text_dataset,
        is_complete,
        read_documents,
    )
    from verispec.training.recipes import RecipeOptions, train_drafter
    from verispec.training.trainer import TrainConfig

    if args.steps < 1 or args.batch_size < 1 or args.lr <= 0:
        raise VerispecError("--steps and --batch-size must be >= 1 and --lr > 0")
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise VerispecError(f"--out {out} exists and is not a directory")
    if args.mid_state and args.kind != "eagle":
        raise VerispecError(f"--mid-state is an EAGLE option; a {args.kind} drafter has no use for it")
    if args.text_data and not args.text:
        raise VerispecError("--text-data is where --text FILE's hidden states go: give --text too")
    if args.text:
        read_documents(args.text)  # a bad corpus fails here, before any data is built
    options = RecipeOptions(loss=args.loss, vocab=args.vocab, heads=args.heads,  # checked here too
                            unroll=args.unroll, exit_layer=args.exit_layer,
                            draft_layers=args.layers, init=args.init, mid_state=args.mid_state)
    target = load_model(args.target, args.dtype, args.device)
    aux_layers = ()  # EAGLE-3 reads the target's states after the engines' default aux layers
    if args.kind == "eagle3":
        from verispec.drafters.eagle3 import default_aux_layers

        aux_layers = default_aux_layers(target.model.config.get_text_config(decoder=True)
                                        .num_hidden_layers)
    data = Path(args.data) if args.data else out / "data"
    if is_complete(data, args.data_batches):
        print(f"verispec: training on the existing data in {data}", file=sys.stderr)
    else:  # builds it, resumes an interrupted build, or adds the batches a larger count asks for
        build_dataset(target, data, num_prompts=args.prompts, max_new_tokens=args.max_new_tokens,
                      exit_layer=args.exit_layer, max_batches=args.data_batches,
                      aux_layers=aux_layers)
    data_dirs = [data]
    if args.text:  # checked against its meta.json (same file, same settings) when reused
        text_data = Path(args.text_data) if args.text_data else out / "text-data"
        data_dirs.append(build_text_dataset(target, args.text, text_data,
                                            exit_layer=args.exit_layer, aux_layers=aux_layers))
    config = TrainConfig(steps=args.steps, lr=args.lr, batch_size=args.batch_size,
                         seed=args.seed, bf16={"auto": None, "on": True, "off": False}[args.bf16])
    saved = train_drafter(args.kind, target, data_dirs, out, config, options)
    print(f"verispec: {args.kind} drafter written to {saved} (loss curve: {saved / 'run' / 'loss.png'}); "
          f"use it with --method {args.kind} --draft {saved}")
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from verispec.drafters.learned import shipped_drafter
    from verispec.export import export_eagle3

    if args.method != "eagle3":
        raise VerispecError(f"only eagle3 drafters export (vLLM and SGLang load no other kind "
                            f"verispec trains), not {args.method!r}")
    target = load_model(args.model, args.dtype, args.device)
    drafter = args.drafter or shipped_drafter(target.model, "eagle3")
    if drafter is None:
        raise VerispecError(f"no trained eagle3 drafter ships for {target.name}: train one with "
                            f"`verispec train eagle3 --target {target.name} --out DIR` and pass "
                            "--drafter DIR")
    k = args.num_speculative_tokens or METHODS["eagle3"].default_k
    out = export_eagle3(drafter, target, args.out, args.format, k, args.verifier)
    print(f"verispec: {args.format} EAGLE-3 drafter written to {out}; serve it with:\n"
          + (out / "README.md").read_text().split("```")[1].strip())
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from verispec.server import create_app, serve

    target = load_model(args.model, args.dtype, args.device)
    app = create_app(target, args.method, max_batch=args.max_batch, max_queue=args.max_queue)
    print(f"verispec: serving {target.name} on http://{args.host}:{args.port}/ (playground there, "
          f"OpenAI API under /v1, metrics at /metrics)", file=sys.stderr)
    serve(app, args.host, args.port, args.drain_seconds)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="verispec", description="Lossless speculative decoding for Hugging Face causal LMs.")
    commands = parser.add_subparsers(dest="command", required=True)

    gen = commands.add_parser("generate", help="generate text with one method, coloured by token fate",
                              description="Generate text from a prompt. Output is exactly the "
                              "target's (greedy: same tokens; sampling: same distribution).")
    add_model_arguments(gen)
    add_method_arguments(gen)
    gen.add_argument("--prompt", required=True, help="the user message (or raw text with --raw)")
    gen.add_argument("--raw", action="store_true", help="do not apply the model's chat template")
    gen.add_argument("--max-new-tokens", type=int, default=128, help="default: 128")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 (default): greedy")
    gen.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (0: off)")
    gen.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass, in (0, 1]")
    gen.add_argument("--seed", type=int, help="seed for sampling; seeded runs repeat exactly")
    gen.add_argument("--stop", action="append", help="stop string (repeatable)")
    gen.add_argument("--json", action="store_true", help="print one JSON object instead")
    gen.add_argument("--color", default="auto", choices=["auto", "always", "never"])
    gen.add_argument("--show-tree", action="store_true",
                     help="with --tree: print every step's candidate tree, the accepted path marked")
    gen.set_defaults(func=cmd_generate)

    demo = commands.add_parser("demo", help="plain vs speculative decoding on the built-in model",
                               description="A few built-in prompts, decoded plainly and with "
                               "speculation, side by side: coloured output, speedup and tau.")
    add_model_arguments(demo)
    add_method_arguments(demo)
    demo.add_argument("--max-new-tokens", type=int, default=96, help="default: 96")
    demo.add_argument("--color", default="auto", choices=["auto", "always", "never"])
    demo.set_defaults(func=cmd_demo)

    bench = commands.add_parser(
        "bench", help="measure every method against Hugging Face generate() (Spec-Bench style)",
        description="Runs Hugging Face generate() baselines and verispec methods interleaved on the "
        "same questions; writes results.json, report.md and PNG plots to --out.")
    add_model_arguments(bench)
    bench.add_argument("--methods", type=comma_list,
                       help="comma-separated; default: every method available for the model. "
                       "hf and ar baselines always run. Also: hf-pld, hf-assisted, hf-early-exit")
    bench.add_argument("--draft", help="draft model for draft / hf-assisted")
    bench.add_argument("--trained", type=comma_list,
                       help="trained drafter directories (from verispec train), comma-separated; "
                       "default: those shipped for the model")
    bench.add_argument("--k", type=comma_ints, help="draft lengths to sweep, e.g. 4,8,16")
    bench.add_argument("--trees", type=tree_list, metavar="TOPKxNODES,...",
                      help="also run each tree-capable method (" + ", ".join(TREE_METHODS) + ") "
                      "with these trees, beside its chain, e.g. 4x8,4x16,8x32 ('default': each "
                      "method's default tree)")
    bench.add_argument("--typical", action="store_true",
                       help="with --temperature > 0: also run each method with typical acceptance "
                       "(LOSSY; labelled so in the report)")
    bench.add_argument("--exit-layer", type=int, help="early exit layers (default: half the target's)")
    bench.add_argument("--questions", help="Spec-Bench-format .jsonl (default: built-in prompts)")
    bench.add_argument("--tasks", type=comma_list, help="only these tasks, e.g. qa,rag")
    bench.add_argument("--limit-per-task", type=int, help="first N questions of each task")
    bench.add_argument("--max-new-tokens", type=int, default=128, help="default: 128")
    bench.add_argument("--temperature", type=float, default=0.0,
                       help="0 (default): greedy, exactness checked")
    bench.add_argument("--seed", type=int, default=0)
    bench.add_argument("--warmup", type=int, default=1, help="untimed runs of each method first")
    bench.add_argument("--batch-size", type=comma_ints, metavar="B,...",
                       help="measure throughput of batches of these sizes instead (e.g. 1,2,4,8,16): "
                            "hf batched, ar batched and each method; default methods pld, "
                            "self-int4-pld, eagle-pld")
    bench.add_argument("--no-load-cap", action="store_true",
                       help="with --batch-size: draft full length at every batch size (the engine "
                            "otherwise shortens drafts as the batch grows)")
    bench.add_argument("--out", default="bench-out", help="output directory (default: bench-out)")
    bench.add_argument("--compare", nargs=2, metavar="RESULTS",
                       help="print the change between two results.json files instead of running")
    bench.set_defaults(func=cmd_bench)

    serve = commands.add_parser(
        "serve", help="an OpenAI-compatible HTTP server with speculative decoding and a playground",
        description="Serves /v1/chat/completions, /v1/completions, /v1/models, /health, /metrics "
        "(Prometheus) and a playground page at /. Requests join and leave one running batch.")
    add_model_arguments(serve)
    serve.add_argument("--method", action="append", choices=list(METHODS),
                       help="a method requests may choose (repeatable; the first is the default; "
                       f"default: the fastest for the model ({FASTEST} or {FALLBACK}), then ar)")
    serve.add_argument("--host", default="127.0.0.1", help="default: 127.0.0.1")
    serve.add_argument("--port", type=int, default=8000, help="default: 8000")
    serve.add_argument("--max-batch", type=int, default=16,
                       help="sequences decoded together at most (default: 16)")
    serve.add_argument("--max-queue", type=int, default=64,
                       help="requests waiting for the batch at most; more get 429 (default: 64)")
    serve.add_argument("--drain-seconds", type=float, default=30.0,
                       help="on SIGTERM, how long requests in flight may take to finish while new "
                       "ones get 503 (default: 30)")
    serve.set_defaults(func=cmd_serve)

    from verispec.training.losses import LOSSES
    from verispec.training.recipes import KINDS, RecipeOptions
    from verispec.training.trainer import TrainConfig

    train = commands.add_parser(
        "train", help="train a drafter for a target (self-distillation)",
        description="Builds self-distillation data (the target's own answers to generated "
        "prompts, with its hidden states; resumable) and trains a drafter on it. Writes "
        "drafter.json + weights.safetensors to --out, plus run/ (checkpoint, loss.png).")
    train.add_argument("kind", choices=KINDS)
    train.add_argument("--target", default=DEFAULT_MODEL, help="the model to draft for")
    train.add_argument("--out", required=True, help="output directory")
    train.add_argument("--data", help="data directory, shared between kinds; reused as it is once "
                       "complete (default: OUT/data)")
    train.add_argument("--prompts", type=int, default=1000, help="training prompts (default: 1000)")
    train.add_argument("--text", metavar="FILE",
                       help="also train on the target's states over this text corpus (.jsonl of "
                       '{"text", "title"} objects, or one document per line): real prose, read '
                       "in one forward pass per batch, no generation")
    train.add_argument("--text-data", metavar="DIR",
                       help="where --text's hidden states are written and reused (default: "
                       "OUT/text-data)")
    train.add_argument("--data-batches", type=int,
                       help="build only this many of the data's batches of 64 prompts (a "
                       "representative subset: batches come in a fixed random order); a larger "
                       "number later adds the missing ones; training reads every batch built")
    train.add_argument("--max-new-tokens", type=int, default=160,
                       help="answer length in the data (default: 160)")
    train.add_argument("--steps", type=int, default=TrainConfig.steps)
    train.add_argument("--lr", type=float, default=TrainConfig.lr)
    train.add_argument("--batch-size", type=int, default=TrainConfig.batch_size)
    train.add_argument("--seed", type=int, default=TrainConfig.seed)
    train.add_argument("--loss", choices=LOSSES, default=RecipeOptions.loss,
                       help="distillation loss: forward KL, reverse KL or total variation")
    train.add_argument("--vocab", type=int, default=RecipeOptions.vocab,
                       help="reduced draft vocabulary size (most frequent tokens)")
    train.add_argument("--heads", type=int, default=RecipeOptions.heads,
                       help="Medusa, Hydra and MTP heads: tokens drafted past the target's own")
    train.add_argument("--layers", type=int, default=RecipeOptions.draft_layers,
                       help="distilled draft model: its own decoder layers")
    train.add_argument("--unroll", type=int, default=RecipeOptions.unroll,
                       help="EAGLE: train on its own predictions this many steps deep")
    train.add_argument("--exit-layer", type=int, help="early exit layer (default: half the target's)")
    train.add_argument("--mid-state", action="store_true",
                       help="EAGLE: also feed the drafter the target's state at the exit layer "
                       "(EAGLE-3-style fused features; the target hands it over while drafting)")
    train.add_argument("--init", help="start from the weights of this trained drafter directory "
                       "(same kind, trained for the same target), e.g. to continue on new data")
    train.add_argument("--dtype", default="float32", choices=list(DTYPES),
                       help="the target's dtype while it answers the training prompts")
    train.add_argument("--bf16", default="auto", choices=["auto", "on", "off"],
                       help="bfloat16 autocast while training (auto: on CUDA and on CPUs with "
                       "native bfloat16 instructions, where it is faster)")
    train.add_argument("--device", default="cpu")
    train.set_defaults(func=cmd_train)

    export = commands.add_parser(
        "export", help="write a trained EAGLE-3 drafter as vLLM or SGLang loads it",
        description="Writes config.json, model.safetensors and a README with the launch line to "
        "--out, in the layout the chosen engine loads (see docs/eagle3.md).")
    add_model_arguments(export)
    export.add_argument("--method", default="eagle3", help="the drafter kind (eagle3)")
    export.add_argument("--drafter", help="a trained eagle3 drafter directory (default: the one "
                        "shipped for --model)")
    export.add_argument("--format", required=True, choices=["vllm", "sglang"])
    export.add_argument("--out", required=True, help="output directory")
    export.add_argument("--num-speculative-tokens", type=int,
                        help="draft length written into the config and launch line (default: "
                        "the method's)")
    export.add_argument("--verifier", help="the target's name as the engine loads it (default: "
                        "its Hugging Face hub name for a built-in model, else --model)")
    export.set_defaults(func=cmd_export)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except VerispecError as error:
        print(f"verispec: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("verispec: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
