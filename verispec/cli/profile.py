"""`verispec profile`: this machine's cost profile of a target, the figures `auto` decides by."""

from __future__ import annotations

import argparse
from pathlib import Path

from verispec.cli import COMMANDS
from verispec.cli.options import add_model_arguments
from verispec.core.errors import VerispecError
from verispec.methods import auto_profile
from verispec.model.loading import load_model
from verispec.profile import cache_dir, cpu_description, plot_profile, profile_table


def add_parser(commands: argparse._SubParsersAction) -> None:
    profile = commands.add_parser(
        "profile", help=COMMANDS["profile"],
        description="Measures (once; cached in $VERISPEC_PROFILE_DIR or "
        "$XDG_CACHE_HOME/verispec/profiles, keyed by the CPU, torch, the model and its kernel) what "
        "one target forward costs over 1..17 rows with 300 tokens cached, the prefill rate, and "
        "each drafter `auto` chooses among: seconds per proposal and per drafted token, and the "
        "acceptance it reached. Prints it as a table.")
    add_model_arguments(profile)
    profile.add_argument("--plot", type=Path, metavar="FILE", help="also draw it (a PNG)")
    profile.add_argument("--refresh", action="store_true", help="measure again, ignoring the cache")
    profile.set_defaults(func=run_command)


def check_plot_path(path: Path) -> None:
    """Before measuring (seconds): the plot's folder exists or is made, and the path is no folder."""
    if path.is_dir():
        raise VerispecError(f"--plot {path} is a directory: give a file name (a PNG)")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise VerispecError(f"--plot {path}: cannot make its folder ({error.strerror or error})") from None


def run_command(args: argparse.Namespace) -> int:
    if args.plot is not None:
        check_plot_path(args.plot)
    target = load_model(args.model, args.dtype, args.device)
    profile = auto_profile(target, refresh=args.refresh)
    print(f"{target.name}, {args.dtype}, on {cpu_description()} (cached in {cache_dir()})")
    print(profile_table(profile))
    if args.plot is not None:
        plot_profile(profile, args.plot, f"{target.name} ({args.dtype}): cost by rows on this machine")
        print(f"plot: {args.plot}")
    return 0
