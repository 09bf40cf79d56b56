"""`verispec bench`: methods against baselines on the same questions (Spec-Bench style), or
throughput against batch size (--batch-size)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from verispec.bench.baselines import BASELINES
from verispec.cli import COMMANDS
from verispec.cli.options import (
    add_draft_options,
    add_model_arguments,
    as_argparse_type,
    comma_list,
    draft_options,
    list_of,
    output_dir,
)
from verispec.core.errors import VerispecError
from verispec.decoding.beam import BeamSettings
from verispec.methods import BATCH_BENCH


def add_parser(commands: argparse._SubParsersAction) -> None:
    bench = commands.add_parser(
        "bench", help=COMMANDS["bench"],
        description="Runs Hugging Face generate() baselines and verispec methods interleaved on the "
        "same questions; writes results.json, report.md and PNG plots to --out.")
    add_model_arguments(bench)
    bench.add_argument("--methods", type=comma_list,
                       help="comma-separated; default: every method available for the model. "
                       "hf and ar baselines always run. Also: "
                       + ", ".join(name for name in BASELINES if name != "hf")
                       + " (llama.cpp: the target's own GGUF through the optional extra "
                       "verispec[llamacpp])")
    bench.add_argument("--trained", type=comma_list,
                       help="trained drafter directories (from verispec train), comma-separated; "
                       "default: those shipped for the model")
    bench.add_argument("--typical", action="store_true",
                       help="with --temperature > 0: also run each method with typical acceptance "
                       "(LOSSY; labelled so in the report)")
    bench.add_argument("--questions", help="Spec-Bench-format .jsonl (default: built-in prompts)")
    bench.add_argument("--tasks", type=comma_list, help="only these tasks, e.g. qa,rag")
    bench.add_argument("--limit-per-task", type=int, help="first N questions of each task")
    bench.add_argument("--max-new-tokens", type=int, default=128, help="default: 128")
    bench.add_argument("--temperature", type=float, default=0.0,
                       help="0 (default): greedy, exactness checked")
    bench.add_argument("--top-k", type=int, default=0, help="with --temperature: keep the k most likely "
                       "tokens (0: off)")
    bench.add_argument("--top-p", type=float, default=1.0, help="with --temperature: nucleus sampling "
                       "mass, in (0, 1]")
    bench.add_argument("--seed", type=int, default=0)
    bench.add_argument("--warmup", type=int, default=1, help="untimed runs of each method first")
    bench.add_argument("--repeats", type=int, default=1, metavar="N",
                       help="time each method N times on each question: the median is recorded and the "
                            "report gives the run-to-run spread (default: 1)")
    bench.add_argument("--batch-size", type=list_of(int), metavar="B,...",
                       help="measure throughput of batches of these sizes instead (e.g. 1,2,4,8,16): "
                            "hf batched, ar batched and each method; default methods "
                            + ", ".join(BATCH_BENCH))
    bench.add_argument("--no-load-cap", action="store_true",
                       help="with --batch-size: draft full length at every batch size (the engine "
                            "otherwise shortens drafts as the batch grows)")
    bench.add_argument("--num-beams", type=int, default=1, metavar="B",
                       help="beam search with B beams (> 1): hf runs generate(num_beams=B), ar "
                            "verispec's plain beam search, each method verispec's speculative beam "
                            "search; each best sequence is compared with Hugging Face's. Greedy only. "
                            "Methods that cannot draft for beam search (beam search drafts with pld, "
                            "self-*, draft and early-exit chains) and the speculative hf-* and "
                            "llama.cpp baselines are refused when named in --methods, all named in "
                            "one error; the default set leaves them out and says which")
    bench.add_argument("--length-penalty", type=float, metavar="X",
                       help="with --num-beams: finished scores are summed log-probs / length ** this "
                            "(Hugging Face's; default 1.0)")
    bench.add_argument("--early-stopping", choices=["false", "true", "never"],
                       help="with --num-beams: Hugging Face's early_stopping (default false)")
    bench.add_argument("--out", default="bench-out", type=as_argparse_type(output_dir),
                       help="output directory (default: bench-out)")
    bench.add_argument("--compare", nargs=2, metavar="RESULTS",
                       help="print the change between two results.json files instead of running")
    add_draft_options(bench, sweep=("k", "tree"), method_flag=False)
    bench.set_defaults(func=run_command)


def run_command(args: argparse.Namespace) -> int:
    from verispec.bench.markdown import compare
    from verispec.bench.records import Results
    from verispec.bench.runner import BenchConfig, run_bench

    if args.compare:
        loaded = []
        for path in args.compare:
            try:
                loaded.append(Results.load(Path(path)))
            except (OSError, ValueError, KeyError, TypeError) as error:
                raise VerispecError(f"cannot read results file {path}: {error}") from error
        print(compare(*loaded))
        return 0
    beams = beam_settings(args)
    draft_as_trained(args)
    if args.batch_size:
        if beams is not None:
            raise VerispecError("--batch-size measures decoding one path: it takes no --num-beams")
        return bench_batched(args)
    if args.no_load_cap:
        raise VerispecError("--no-load-cap sets the draft length at each batch size: "
                            "it goes with --batch-size")
    config = BenchConfig(model=args.model, out=Path(args.out), methods=args.methods, ks=args.k,
                         draft=args.draft, trained=args.trained, exit_layer=args.exit_layer,
                         options=draft_options(args, k=None, tree=None),
                         questions=Path(args.questions) if args.questions else None, tasks=args.tasks,
                         limit_per_task=args.limit_per_task, max_new_tokens=args.max_new_tokens,
                         temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                         seed=args.seed, warmup=args.warmup, repeats=args.repeats,
                         dtype=args.dtype, device=args.device, trees=args.tree,
                         typical=args.typical, beams=beams)
    results = run_bench(config)
    print((Path(args.out) / "report.md").read_text() if results.runs else "no runs finished")
    if results.interrupted:
        print(f"verispec: interrupted; results so far are in {args.out}", file=sys.stderr)
        return 130
    return 0


def draft_as_trained(args: argparse.Namespace) -> None:
    """A trained drafter directory given as --draft (as `generate` takes one) joins --trained: the
    bench's --draft is otherwise the draft model of `draft` and Hugging Face's assisted peers."""
    from verispec.drafters.learned import is_drafter_dir

    if args.draft is not None and is_drafter_dir(args.draft):
        args.trained, args.draft = [*(args.trained or []), args.draft], None


def beam_settings(args: argparse.Namespace) -> BeamSettings | None:
    """The beam search --num-beams, --length-penalty and --early-stopping ask for; None: one path."""
    if args.num_beams == 1:
        given = [flag for flag, value in (("--length-penalty", args.length_penalty),
                                          ("--early-stopping", args.early_stopping)) if value is not None]
        if given:
            raise VerispecError(f"{' and '.join(given)} set beam search: give --num-beams B > 1 too")
        return None
    early = {"false": False, "true": True, "never": "never"}[args.early_stopping or "false"]
    return BeamSettings(args.num_beams, 1.0 if args.length_penalty is None else args.length_penalty, early)


def bench_batched(args: argparse.Namespace) -> int:
    """`--batch-size`: every flag it is given is honoured, or refused here by name."""
    from verispec.bench.batched import BatchBenchConfig, run_batched_bench

    if args.repeats != 1:
        raise VerispecError("--repeats times one path's runs: it goes without --batch-size")
    if args.trained:
        raise VerispecError("--batch-size runs trained methods with the drafters shipped for the model: "
                            "it takes no --trained (nor a trained drafter as --draft)")
    config = BatchBenchConfig(model=args.model, out=Path(args.out), batch_sizes=args.batch_size,
                              methods=args.methods, ks=args.k,
                              questions=Path(args.questions) if args.questions else None,
                              tasks=args.tasks, limit_per_task=args.limit_per_task,
                              max_new_tokens=args.max_new_tokens, dtype=args.dtype, device=args.device,
                              seed=args.seed, load_cap=not args.no_load_cap,
                              temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                              draft=args.draft, trees=args.tree, typical=args.typical, warmup=args.warmup,
                              options=draft_options(args, k=None, tree=None))
    run_batched_bench(config)
    print((Path(args.out) / "batched.md").read_text())
    return 0
