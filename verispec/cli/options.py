"""Flags shared by several commands: the model's, and the drafting options derived from
DraftOptions' declaration (verispec.options), so each setting is declared once."""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from verispec.core.errors import VerispecError
from verispec.methods import BEAM_DEFAULT, DEFAULT_METHOD, METHODS
from verispec.model.loading import ALIASES, DEFAULT_MODEL, PRECISIONS, builtin_names
from verispec.options import DraftOptions, option_flags


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=DEFAULT_MODEL,
                        help=f"built-in name ({', '.join(builtin_names())}), a Hugging Face model "
                             f"directory or a .gguf file (default: {DEFAULT_MODEL})")
    parser.add_argument("--dtype", default="float32", choices=[*PRECISIONS, *ALIASES],
                        help="the target's weights and compute: float32, bfloat16, float16, or int4 "
                             "(4-bit weights: a GGUF's own Q4_0/Q4_1 blocks, else groups of 32 "
                             "quantized at load; CPU); exactness is relative to this target")
    parser.add_argument("--device", default="cpu", help="cpu or cuda (default: cpu)")


def method_help() -> str:
    return ("; ".join(f"{m.name}: {m.description}" for m in METHODS.values())
            + f" (default: {DEFAULT_METHOD}; {BEAM_DEFAULT} with --num-beams)")


# Registry facts appended to a derived flag's help.
EXTRA_HELP: dict[str, Callable[[], str]] = {
    "k": lambda: "; defaults: " + ", ".join(f"{m.name} {m.default_k}" for m in METHODS.values()
                                            if m.build),
    "tree": lambda: "; default trees: " + ", ".join(
        f"{m.name} {m.default_tree.topk}x{m.default_tree.nodes}"
        for m in METHODS.values() if m.default_tree),
}


def as_argparse_type(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    """A parser whose VerispecError argparse reports as a usage error."""
    def convert(text: str) -> Any:
        try:
            return parse(text)
        except VerispecError as error:
            raise argparse.ArgumentTypeError(str(error)) from None
    convert.__name__ = getattr(parse, "__name__", "value")
    return convert


def output_dir(text: str) -> str:
    """An output directory that is one or can be made (the command makes it), checked as the
    flags are read: before a model loads or anything runs, and without making anything."""
    path = Path(text).absolute()
    if path.exists() and not path.is_dir():
        raise VerispecError(f"{text} is a file, not a directory")
    ancestor = path
    while not ancestor.exists():
        ancestor = ancestor.parent
    if not ancestor.is_dir() or not os.access(ancestor, os.W_OK | os.X_OK):
        raise VerispecError(f"cannot make {text}: {ancestor} is not a directory this process may write in")
    return text


def comma_list(text: str) -> list[str]:
    return [item.strip() for item in text.split(",") if item.strip()]


def list_of(parse: Callable[[str], Any]) -> Callable[[str], list[Any]]:
    """Comma-separated values, each read by `parse`."""
    def convert(text: str) -> list[Any]:
        return [parse(item) for item in comma_list(text)]
    convert.__name__ = f"list of {getattr(parse, '__name__', 'value')}"
    return as_argparse_type(convert)


def add_draft_options(parser: argparse.ArgumentParser, sweep: tuple[str, ...] = (),
                      method_flag: bool = True) -> None:
    """--method plus one flag per DraftOptions field; fields in `sweep` take comma-separated
    lists (the bench runs every value)."""
    if method_flag:
        parser.add_argument("--method", choices=list(METHODS), help=method_help())
    group = parser.add_argument_group("drafting options")
    for name, default, flag in option_flags():
        dest = "--" + name.replace("_", "-")
        help_text = flag.help + (EXTRA_HELP[name]() if name in EXTRA_HELP else "")
        if flag.parse is None:
            group.add_argument(dest, action=argparse.BooleanOptionalAction, default=default,
                               help=help_text)
            continue
        kwargs: dict[str, Any] = {"default": None if name in sweep else default,
                                  "metavar": flag.metavar, "help": help_text}
        if name in sweep:
            kwargs["type"] = list_of(flag.parse)
            kwargs["help"] += " (comma-separated: each is run)"
            if flag.metavar:
                kwargs["metavar"] = f"{flag.metavar},..."
        else:
            kwargs["type"] = as_argparse_type(flag.parse)
            if flag.choices:
                kwargs["choices"] = list(flag.choices)
            if flag.bare is not None:
                kwargs.update(nargs="?", const=flag.bare)
        group.add_argument(dest, **kwargs)


def draft_options(args: argparse.Namespace, **overrides: Any) -> DraftOptions:
    """The DraftOptions the parsed flags give (swept fields are given in `overrides`)."""
    values = {name: getattr(args, name) for name, _, _ in option_flags()}
    values.update(overrides)
    return DraftOptions(**values)
