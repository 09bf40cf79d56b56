"""The `verispec` command: one module per subcommand, each with add_parser and run_command."""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from verispec.core.cores import usable_cores
from verispec.core.errors import VerispecError

# Each subcommand (its module, verispec.cli.<name>) and the line `verispec --help` shows for it.
COMMANDS = {
    "generate": "generate text with one method, coloured by token fate",
    "demo": "plain vs speculative decoding on the built-in model",
    "bench": "measure every method against Hugging Face generate() (Spec-Bench style)",
    "serve": "an OpenAI-compatible HTTP server with speculative decoding and a playground",
    "train": "train a drafter for a target (self-distillation), or the byte model",
    "export": "write a trained EAGLE-3 drafter as vLLM or SGLang loads it",
    "profile": "the target's forward cost by rows and each drafter's cost, on this machine",
}


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser with every subcommand's options, or with `command`'s only (the others by name
    and summary): a subcommand's options import its module, most of them torch and the method
    registry (seconds), which `verispec --help` should not wait for."""
    parser = argparse.ArgumentParser(
        prog="verispec", description="Lossless speculative decoding for Hugging Face causal LMs.")
    commands = parser.add_subparsers(dest="command", required=True)
    for name, summary in COMMANDS.items():
        if command is None or name == command:
            importlib.import_module(f"verispec.cli.{name}").add_parser(commands)
        else:
            commands.add_parser(name, help=summary)
    return parser


def fit_threads() -> None:
    """torch starts as many threads as the machine shows cores; in a container held to fewer by a
    CPU quota the extra threads only queue for the quota's time, and a product waits for its
    slowest thread: hold them to the quota's cores, unless the user chose (OMP_NUM_THREADS)."""
    if "OMP_NUM_THREADS" in os.environ:
        return
    import torch

    cores = usable_cores()
    if torch.get_num_threads() > cores:
        torch.set_num_threads(cores)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    named = next((arg for arg in argv if not arg.startswith("-")), "")  # no option comes before it
    args = build_parser(named if named in COMMANDS else "").parse_args(argv)
    fit_threads()
    try:
        return args.func(args)
    except VerispecError as error:
        print(f"verispec: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("verispec: interrupted", file=sys.stderr)
        return 130
