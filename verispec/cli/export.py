"""`verispec export`: a trained EAGLE-3 drafter written as vLLM or SGLang loads it."""

from __future__ import annotations

import argparse

from verispec.cli import COMMANDS
from verispec.cli.options import add_model_arguments, as_argparse_type, output_dir
from verispec.core.errors import VerispecError
from verispec.drafters.eagle3 import Eagle3Drafter
from verispec.methods import METHODS
from verispec.model.loading import load_model


def add_parser(commands: argparse._SubParsersAction) -> None:
    export = commands.add_parser(
        "export", help=COMMANDS["export"],
        description="Writes config.json, model.safetensors and a README with the launch line to "
        "--out, in the layout the chosen engine loads (see docs/eagle3.md).")
    add_model_arguments(export)
    export.add_argument("--method", default=Eagle3Drafter.kind,
                        help=f"the drafter kind ({Eagle3Drafter.kind})")
    export.add_argument("--drafter", help=f"a trained {Eagle3Drafter.kind} drafter directory "
                        "(default: the one shipped for --model)")
    export.add_argument("--format", required=True, choices=["vllm", "sglang"])
    export.add_argument("--out", required=True, type=as_argparse_type(output_dir), help="output directory")
    export.add_argument("--num-speculative-tokens", type=int,
                        help="draft length written into the config and launch line (default: "
                        "the method's)")
    export.add_argument("--verifier", help="the target's name as the engine loads it (default: "
                        "its Hugging Face hub name for a built-in model, else --model)")
    export.set_defaults(func=run_command)


def run_command(args: argparse.Namespace) -> int:
    from verispec.drafters.learned import shipped_drafter
    from verispec.export import export_eagle3

    kind = Eagle3Drafter.kind
    if args.method != kind:
        raise VerispecError(f"only {kind} drafters export (vLLM and SGLang load no other kind "
                            f"verispec trains), not {args.method!r}")
    target = load_model(args.model, args.dtype, args.device)
    drafter = args.drafter or shipped_drafter(target.model, kind)
    if drafter is None:
        raise VerispecError(f"no trained {kind} drafter ships for {target.name}: train one with "
                            f"`verispec train {kind} --target {target.name} --out DIR` and pass "
                            "--drafter DIR")
    k = args.num_speculative_tokens or METHODS[kind].default_k
    out = export_eagle3(drafter, target, args.out, args.format, k, args.verifier)
    print(f"verispec: {args.format} EAGLE-3 drafter written to {out}; serve it with:\n"
          + (out / "README.md").read_text().split("```")[1].strip())
    return 0
