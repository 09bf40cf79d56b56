"""`verispec generate`: one prompt, one method, the output coloured by each token's fate."""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict
from pathlib import Path

from verispec.cli import COMMANDS
from verispec.cli.options import add_draft_options, add_model_arguments, draft_options
from verispec.core.errors import VerispecError
from verispec.core.types import SamplingParams
from verispec.decoding.beam import BeamResult
from verispec.display import (
    FORCED_LEGEND,
    LEGEND,
    acceptance_line,
    choices_line,
    render_steps,
    render_tree,
    stats_table,
)
from verispec.methods import BEAM_DEFAULT, DEFAULT_METHOD, PLAIN
from verispec.model.loading import load_model
from verispec.request import build_request, run


def use_colour(choice: str) -> bool:
    if choice == "auto":
        return sys.stdout.isatty() and "NO_COLOR" not in os.environ
    return choice == "always"


def read_file(path: str | None, what: str) -> str | None:
    """The text of a file named on the command line (None: not given)."""
    if path is None:
        return None
    try:
        return Path(path).read_text()
    except OSError as error:
        raise VerispecError(f"cannot read the {what} file {path}: {error.strerror}") from None


def print_beams(results: BeamResult | list[BeamResult], as_json: bool) -> int:
    """Beam search's returned sequences, best first, with their scores and search statistics."""
    results = results if isinstance(results, list) else [results]
    if as_json:
        print(json.dumps({"sequences": [{"text": r.text, "token_ids": r.token_ids, "score": r.score}
                                        for r in results], "stats": asdict(results[0].stats)}))
        return 0
    for rank, result in enumerate(results, 1):
        print(f"[{rank}] score {result.score:.4f}\n{result.text}\n")
    stats = results[0].stats
    print(f"beam search: {stats.steps} steps in {stats.target_forwards} target passes, "
          f"{stats.drafted} draft tokens")
    return 0


def add_parser(commands: argparse._SubParsersAction) -> None:
    gen = commands.add_parser("generate", help=COMMANDS["generate"],
                              description="Generate text from a prompt. Output is exactly the "
                              "target's (greedy: same tokens; sampling: same distribution).")
    add_model_arguments(gen)
    add_draft_options(gen)
    gen.add_argument("--prompt", required=True, help="the user message (or raw text with --raw)")
    gen.add_argument("--raw", action="store_true", help="do not apply the model's chat template (a model "
                     "without one, such as a base model, always takes the prompt raw)")
    gen.add_argument("--max-new-tokens", type=int, default=128, help="default: 128")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 (default): greedy")
    gen.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (0: off)")
    gen.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass, in (0, 1]")
    gen.add_argument("--seed", type=int, help="seed for sampling; seeded runs repeat exactly")
    gen.add_argument("--stop", action="append", help="stop string (repeatable)")
    gen.add_argument("--json", action="store_true", help="print one JSON object instead")
    gen.add_argument("--prediction", metavar="FILE",
                     help="a predicted output (the file being edited, say): drafted first wherever "
                     "the output is in it; exact whatever it says")
    gen.add_argument("--json-schema", metavar="FILE",
                     help="the output is JSON matching this JSON schema (constrained decoding: the "
                     "target's distribution masked to what the schema allows; exact with every method)")
    gen.add_argument("--regex", help="the output matches this regular expression (constrained decoding)")
    gen.add_argument("--grammar", metavar="FILE",
                     help="the output matches this Lark grammar (llguidance's dialect; constrained decoding)")
    gen.add_argument("--num-beams", type=int, default=1, metavar="B",
                     help="beam search with B beams (exactly plain beam search's result, several "
                     "search steps per target pass where the method's drafts allow; greedy only)")
    gen.add_argument("--length-penalty", type=float, default=1.0,
                     help="beam search: finished scores are log-prob sums / length ** this (default 1)")
    gen.add_argument("--early-stopping", default="false", choices=["false", "true", "never"],
                     help="beam search's stopping rule, as Hugging Face's (default: false)")
    gen.add_argument("--num-return-sequences", type=int, default=1, metavar="N",
                     help="beam search: print the N best sequences (N <= B)")
    gen.add_argument("--color", default="auto", choices=["auto", "always", "never"])
    gen.add_argument("--show-tree", action="store_true",
                     help="with --tree: print every step's candidate tree, the accepted path marked")
    gen.set_defaults(func=run_command)


def run_command(args: argparse.Namespace) -> int:
    if args.num_return_sequences != 1 and args.num_beams == 1:
        raise VerispecError("--num-return-sequences N prints beam search's N best: give --num-beams B >= N")
    target = load_model(args.model, args.dtype, args.device)
    args.method = args.method or (BEAM_DEFAULT if args.num_beams > 1 else DEFAULT_METHOD)
    request = build_request(
        target, args.prompt, chat=False if args.raw else None, method=args.method,
        options=draft_options(args),
        sampling=SamplingParams.of(args.temperature, args.top_k, args.top_p),
        max_new_tokens=args.max_new_tokens, stop_strings=args.stop, seed=args.seed,
        sequences=args.num_return_sequences, prediction=read_file(args.prediction, "prediction"),
        json_schema=read_file(args.json_schema, "JSON schema"), regex=args.regex,
        grammar=read_file(args.grammar, "grammar"), num_beams=args.num_beams,
        length_penalty=args.length_penalty,
        early_stopping={"false": False, "true": True}.get(args.early_stopping, "never"))
    if request.beams is not None:
        return print_beams(run(target, request), args.json)
    result = run(target, request)
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
    forced = result.stats.forced_tokens > 0
    if colour and (args.method != PLAIN or forced):
        print(LEGEND + (FORCED_LEGEND if forced else ""))
    print(stats_table({args.method: result.stats}))
    if args.method != PLAIN:
        print(acceptance_line(result.stats))
    if result.stats.choices:
        print(f"{args.method} {choices_line(result.stats)}")
    if forced:
        print(f"forced by the grammar: {result.stats.forced_tokens} tokens, drafted for free")
    return 0
