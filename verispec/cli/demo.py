"""`verispec demo`: built-in prompts decoded plainly and with speculation, side by side."""

from __future__ import annotations

import argparse

import torch

from verispec.cli import COMMANDS
from verispec.cli.generate import use_colour
from verispec.cli.options import add_draft_options, add_model_arguments, draft_options
from verispec.core.cores import OthersLoad
from verispec.core.types import GenerationStats
from verispec.display import LEGEND, choices_line, render_steps, stats_table
from verispec.methods import DEFAULT_METHOD, PLAIN, auto_profile
from verispec.model.loading import load_model
from verispec.profile import CROWDED, cpu_description, profile_table
from verispec.request import build_request, run

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


def add_parser(commands: argparse._SubParsersAction) -> None:
    demo = commands.add_parser("demo", help=COMMANDS["demo"],
                               description="A few built-in prompts, decoded plainly and with "
                               "speculation, side by side: coloured output, speedup and tau.")
    add_model_arguments(demo)
    add_draft_options(demo)
    demo.add_argument("--max-new-tokens", type=int, default=96, help="default: 96")
    demo.add_argument("--color", default="auto", choices=["auto", "always", "never"])
    demo.set_defaults(func=run_command)


def run_command(args: argparse.Namespace) -> int:
    target = load_model(args.model, args.dtype, args.device)
    args.method = args.method or DEFAULT_METHOD
    if args.method == DEFAULT_METHOD:
        print(f"{DEFAULT_METHOD} decides by this machine's cost profile of {target.name} on "
              f"{cpu_description()} (measured once, then cached; `verispec profile` draws it):",
              flush=True)
        print(profile_table(auto_profile(target, draft_options(args))))
    colour = use_colour(args.color)
    totals: dict[str, list] = {PLAIN: [], args.method: []}
    for method in totals:  # warm-up: the first forward passes are slow; keep them out of timings
        run(target, build_request(target, DEMO_PROMPTS[0], method=method, options=draft_options(args),
                                  max_new_tokens=4, chat=None))
    with OthersLoad() as others:
        for prompt in DEMO_PROMPTS:
            print(f"\n>>> {prompt}")
            for method in totals:
                request = build_request(target, prompt, method=method, options=draft_options(args),
                                        max_new_tokens=args.max_new_tokens, chat=None)
                totals[method].append(run(target, request))
            plain, fast = totals[PLAIN][-1], totals[args.method][-1]
            print(render_steps(fast.steps, target.tokenizer, colour))
            same = "identical to" if plain.token_ids == fast.token_ids else "DIFFERENT from"
            print(f"[{args.method}: {fast.stats.tokens_per_second:.1f} tok/s, tau "
                  f"{fast.stats.mean_accepted_tokens:.2f}; ar: {plain.stats.tokens_per_second:.1f} tok/s; "
                  f"output {same} plain decoding]")
            if fast.stats.choices:
                print(f"[{args.method} {choices_line(fast.stats)}]")
    if colour:
        print("\n" + LEGEND)
    print()
    seconds = {m: sum(r.stats.total_seconds for r in rs) for m, rs in totals.items()}
    merged = {m: GenerationStats.total([r.stats for r in rs]) for m, rs in totals.items()}
    print(stats_table(merged))
    print(f"\nspeedup of {args.method} over plain decoding (same run, same prompts): "
          f"{seconds[PLAIN] / seconds[args.method]:.2f}x, tau {merged[args.method].mean_accepted_tokens:.2f}")
    if others.took(torch.get_num_threads(), CROWDED):
        print(f"(a busy machine: other processes kept {others.cores:.1f} of {others.capacity:g} cores "
              "busy while these ran; the speedup is not this machine's alone)")
    return 0
