"""The `verispec` command: one module per subcommand, each with add_parser and run_command."""

from __future__ import annotations

import argparse
import sys

from verispec.cli import bench, demo, export, generate, profile, serve, train
from verispec.core.errors import VerispecError

COMMANDS = (generate, demo, bench, serve, train, export, profile)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="verispec", description="Lossless speculative decoding for Hugging Face causal LMs.")
    commands = parser.add_subparsers(dest="command", required=True)
    for command in COMMANDS:
        command.add_parser(commands)
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
