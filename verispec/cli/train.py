"""`verispec train KIND`: self-distillation data for a target, and a drafter trained on it; or
`verispec train bytes`: verispec's byte model with its multi-token heads, from scratch."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, replace
from pathlib import Path

from verispec.cli import COMMANDS
from verispec.cli.options import as_argparse_type, output_dir
from verispec.core.errors import VerispecError
from verispec.model.loading import DEFAULT_MODEL, PRECISIONS, load_model


def add_parser(commands: argparse._SubParsersAction) -> None:
    from verispec.training.bytes import BYTE_TRAINING, BYTES_KIND, ByteModelOptions
    from verispec.training.losses import LOSSES
    from verispec.training.recipes import KINDS, RecipeOptions
    from verispec.training.trainer import TrainConfig

    bytes_ = ByteModelOptions()
    train = commands.add_parser(
        "train", help=COMMANDS["train"],
        description="Builds self-distillation data (the target's own answers to generated "
        "prompts, with its hidden states; resumable) and trains a drafter on it. Writes "
        "drafter.json + weights.safetensors to --out, plus run/ (checkpoint, loss.png). "
        f"`{BYTES_KIND}` instead trains a byte-level model from scratch with multi-token heads "
        "(docs/bytes.md) on the standard library's source and the --target's answers: OUT/model "
        "(a model directory) and OUT/mtp (its heads as a drafter). Where two defaults are "
        f"given, the second is {BYTES_KIND}'s. `{DATA_KIND}` only builds data with the data "
        "engine (--source, --mode, --tokens) into --out, for `--data OUT` of any kind.")
    train.add_argument("kind", choices=[*KINDS, BYTES_KIND, DATA_KIND])
    train.add_argument("--target", default=DEFAULT_MODEL,
                       help=f"the model to draft for ({BYTES_KIND}: the model whose answers it reads)")
    train.add_argument("--out", required=True, type=as_argparse_type(output_dir), help="output directory")
    train.add_argument("--data", help="data directory, shared between kinds; reused as it is once "
                       "complete (default: OUT/data)")
    add_data_engine_arguments(train)
    train.add_argument("--prompts", type=int,
                       help=f"training prompts (default: 1000; {bytes_.prompts})")
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
                       "number later adds the missing ones; training reads every batch built "
                       "(bytes: of the --target's answers, in prompt order)")
    train.add_argument("--max-new-tokens", type=int,
                       help=f"answer length in the data (default: 160, the data engine's 256; "
                       f"{bytes_.max_new_tokens})")
    train.add_argument("--steps", type=int,
                       help=f"default: {TrainConfig.steps}; {BYTE_TRAINING.steps}")
    train.add_argument("--stop-at", type=int, metavar="STEP",
                       help="stop and export at this step of the --steps schedule, with a held-out "
                       "evaluation there (run again with a later STEP, or none, to resume from "
                       "OUT/run's checkpoint: a long run in parts, each part a usable drafter)")
    train.add_argument("--lr", type=float, help=f"default: {TrainConfig.lr}; {BYTE_TRAINING.lr}")
    train.add_argument("--batch-size", type=int,
                       help=f"default: {TrainConfig.batch_size}; {BYTE_TRAINING.batch_size}")
    train.add_argument("--seed", type=int, default=TrainConfig.seed)
    train.add_argument("--loss", choices=LOSSES, default=RecipeOptions.loss,
                       help="distillation loss: forward KL, reverse KL or total variation")
    train.add_argument("--vocab", type=int, default=RecipeOptions.vocab,
                       help="reduced draft vocabulary size (most frequent tokens)")
    train.add_argument("--heads", type=int,
                       help="Medusa, Hydra and MTP heads: tokens drafted past the target's own "
                       f"(default: {RecipeOptions.heads}; {bytes_.heads}, and 0 trains the byte "
                       "model on next-byte prediction alone)")
    train.add_argument("--layers", type=int,
                       help="distilled draft model and block drafter: their own decoder layers; "
                       "the byte model's "
                       f"(default: {RecipeOptions.draft_layers}; {bytes_.layers})")
    train.add_argument("--hidden", type=int, default=bytes_.hidden,
                       help=f"{BYTES_KIND}: the model's width (default: {bytes_.hidden})")
    train.add_argument("--context", type=int, default=bytes_.context,
                       help=f"{BYTES_KIND}: positions, and the training windows' length "
                       f"(default: {bytes_.context})")
    train.add_argument("--block", type=int,
                       help=f"block drafter: rows of a block, the newest token and block - 1 "
                       f"tokens drafted in one pass (default: {RecipeOptions.block})")
    train.add_argument("--unroll", type=int,
                       help="EAGLE and EAGLE-3: train on their own predictions this many steps "
                       f"deep (default: {RecipeOptions.unroll})")
    train.add_argument("--exit-layer", type=int, help="early exit layer (default: half the target's)")
    train.add_argument("--mid-state", action="store_true",
                       help="EAGLE: also feed the drafter the target's state at the exit layer "
                       "(EAGLE-3-style fused features; the target hands it over while drafting)")
    train.add_argument("--init", help="start from the weights of this trained drafter directory "
                       "(same kind, trained for the same target), e.g. to continue on new data")
    train.add_argument("--dtype", default="float32", choices=list(PRECISIONS),
                       help="the target's dtype while it answers the training prompts")
    train.add_argument("--bf16", default="auto", choices=["auto", "on", "off"],
                       help="bfloat16 autocast while training (auto: on CUDA and on CPUs with "
                       "native bfloat16 instructions, where it is faster)")
    train.add_argument("--device", default="cpu")
    train.set_defaults(func=run_command)


def add_data_engine_arguments(train: argparse.ArgumentParser) -> None:
    """The data engine's flags (verispec.training.data_engine)."""
    from verispec.training.data_engine import MODES
    from verispec.training.sources import SHAREGPT, TEMPLATES

    train.add_argument("--source",
                       help=f"the data engine (docs/training.md): {SHAREGPT!r} (ShareGPT conversations, "
                       f"the optional extra verispec[sharegpt]; training only), {TEMPLATES!r} (the "
                       "templated prompts), a .jsonl file (prompt/reply, conversations, messages "
                       "or text records) or a data directory (another build's sequences read as "
                       "they are, --mode teacher: the states --for asks, no generation); builds "
                       "--data from it instead of the templated prompts")
    train.add_argument("--mode", choices=MODES, default="self",
                       help="data engine: self (the target answers the source's prompts) or "
                       "teacher (the source's own replies, read in one forward: no generation)")
    train.add_argument("--tokens", type=int, default=1_000_000,
                       help="data engine: reply tokens of training data to build (a larger number "
                       "later adds to it; default: 1000000)")
    train.add_argument("--held-out", type=float, default=0.02,
                       help="data engine: the fraction of the source's prompts held out, and of "
                       "--tokens built from them into DATA/held-out (the evaluation set)")
    train.add_argument("--for", dest="for_kinds", metavar="KINDS",
                       help="data engine: store only the target's states these kinds (comma-"
                       "separated) read: eagle, medusa, hydra, mtp and draft read its final state "
                       "alone, a fifth of the disk; early-exit (and eagle with --mid-state) the "
                       "exit layer's too; eagle3 and block three aux layers' too (default: every "
                       "kind's)")


def run_command(args: argparse.Namespace) -> int:
    from verispec.training.bytes import BYTE_TRAINING, BYTES_KIND
    from verispec.training.data import (
        build_dataset,
        build_text_dataset,
        is_complete,
        read_documents,
    )
    from verispec.training.data_engine import build_data
    from verispec.training.recipes import RECIPES, RecipeOptions, train_drafter
    from verispec.training.trainer import TrainConfig, describe_fit

    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise VerispecError(f"--out {out} exists and is not a directory")
    if args.kind == DATA_KIND:  # before the training options' checks: it refuses them all
        return build_data_command(args, out)
    byte_model = args.kind == BYTES_KIND
    defaults = BYTE_TRAINING if byte_model else TrainConfig()
    steps, lr, batch_size = (defaults.steps if args.steps is None else args.steps,
                             defaults.lr if args.lr is None else args.lr,
                             defaults.batch_size if args.batch_size is None else args.batch_size)
    if steps < 1 or batch_size < 1 or lr <= 0:
        raise VerispecError("--steps and --batch-size must be >= 1 and --lr > 0")
    bf16 = {"auto": None, "on": True, "off": False}[args.bf16]
    if args.stop_at is not None and not 1 <= args.stop_at <= steps:
        raise VerispecError(f"--stop-at must lie in 1..--steps ({steps}), got {args.stop_at}")
    if args.source is None and (args.tokens != 1_000_000 or args.mode != "self"):
        raise VerispecError("--tokens and --mode size and shape the data engine's data: give --source")
    if args.source is None and args.for_kinds is not None:
        raise VerispecError("--for chooses the states the data engine stores: give --source")
    if args.source is not None and (args.prompts or args.data_batches):
        raise VerispecError("--prompts and --data-batches size the templated data; with --source, "
                            "--tokens sizes the data")
    if byte_model:
        return train_bytes(args, out, replace(defaults, steps=steps, lr=lr, batch_size=batch_size,
                                              seed=args.seed, bf16=bf16))
    kind = RECIPES[args.kind]
    given = {option: getattr(args, dest) for option, dest in KIND_FLAGS.items()
             if getattr(args, dest) is not None and getattr(args, dest) is not False}
    foreign = [flag(option) for option in given if option not in kind.options]
    if foreign:
        own = sorted(flag(option) for option in kind.options & KIND_FLAGS.keys())
        raise VerispecError(f"{', '.join(foreign)}: not an option of the {args.kind} drafter "
                            f"(its own: {', '.join(own) or 'none'})")
    if args.text_data and not args.text:
        raise VerispecError("--text-data is where --text FILE's hidden states go: give --text too")
    if args.text:
        read_documents(args.text)  # a bad corpus fails here, before any data is built
    options = RecipeOptions(loss=args.loss, vocab=args.vocab, init=args.init,  # checked here too
                            exit_layer=args.exit_layer, **given)
    target = load_model(args.target, args.dtype, args.device)
    # EAGLE-3 and the block drafter read the target's states after the engines' default aux
    # layers; the data engine's data holds them for every kind, unless --for says which
    stored = stored_states(args.for_kinds, args.mid_state)
    if args.source and args.kind not in stored.kinds:
        raise VerispecError(f"--for {args.for_kinds}: the data is for other kinds than {args.kind}")
    aux_layers = aux_layers_of(target) if kind.reads_aux or (args.source and stored.aux) else ()
    data = Path(args.data) if args.data else out / "data"
    if args.source:  # the data engine: resumes, or adds what a larger --tokens asks for
        build_data(target, data, args.source, args.mode, args.tokens, args.held_out,
                   max_new_tokens=256 if args.max_new_tokens is None else args.max_new_tokens,
                   seed=args.seed, exit_layer=args.exit_layer, aux_layers=aux_layers,
                   exit_states=stored.exit)
    elif is_complete(data, args.data_batches):
        print(f"verispec: training on the existing data in {data}", file=sys.stderr)
    else:  # builds it, resumes an interrupted build, or adds the batches a larger count asks for
        build_dataset(target, data, num_prompts=1000 if args.prompts is None else args.prompts,
                      max_new_tokens=160 if args.max_new_tokens is None else args.max_new_tokens,
                      exit_layer=args.exit_layer, max_batches=args.data_batches,
                      aux_layers=aux_layers)
    data_dirs = [data]
    if args.text:  # checked against its meta.json (same file, same settings) when reused
        text_data = Path(args.text_data) if args.text_data else out / "text-data"
        data_dirs.append(build_text_dataset(target, args.text, text_data,
                                            exit_layer=args.exit_layer, aux_layers=aux_layers))
    config = TrainConfig(steps=steps, lr=lr, batch_size=batch_size, seed=args.seed, bf16=bf16)
    saved = train_drafter(args.kind, target, data_dirs, out, config, options, until=args.stop_at)
    report = json.loads((saved / "drafter.json").read_text())["training"]["fit"]
    if report is not None:
        print(f"verispec: {describe_fit(report)}", file=sys.stderr)
    print(f"verispec: {args.kind} drafter written to {saved} (loss curve: {saved / 'run' / 'loss.png'}); "
          f"use it with --method {args.kind} --draft {saved}")
    return 0


DATA_KIND = "data"  # `verispec train data`: the data engine alone


def aux_layers_of(target) -> tuple[int, ...]:
    """The aux layers EAGLE-3 and the block drafter read: the engines' default ones."""
    from verispec.drafters.eagle3 import default_aux_layers

    return default_aux_layers(target.model.config.get_text_config(decoder=True).num_hidden_layers)


@dataclass(frozen=True)
class StoredStates:
    """What the data engine stores beside the target's final state, for these kinds."""

    kinds: tuple[str, ...]
    aux: bool  # the aux layers' states (EAGLE-3, the block drafter)
    exit: bool  # the exit layer's (a trained early exit, EAGLE's --mid-state)


def stored_states(for_kinds: str | None, mid_state: bool = False) -> StoredStates:
    """The states --for KINDS asks the data engine to store (None: every kind's); mid_state:
    also the exit layer's, which EAGLE's --mid-state reads."""
    from verispec.training.recipes import KINDS, RECIPES

    if for_kinds is None:
        return StoredStates(KINDS, True, True)
    kinds = tuple(k.strip() for k in for_kinds.split(",") if k.strip())
    unknown = [k for k in kinds if k not in RECIPES]
    if unknown or not kinds:
        raise VerispecError(f"--for {for_kinds!r}: name kinds from {', '.join(KINDS)}, "
                            "comma-separated")
    return StoredStates(kinds, any(RECIPES[k].reads_aux for k in kinds),
                        mid_state or any(RECIPES[k].reads_exit for k in kinds))


def build_data_command(args: argparse.Namespace, out: Path) -> int:
    """`verispec train data`: the data engine into --out (training shards, OUT/held-out)."""
    from verispec.training.data_engine import HELD_OUT, build_data

    if args.source is None:
        raise VerispecError("verispec train data builds from a --source (sharegpt, templates, "
                            "a .jsonl file or a data directory)")
    if args.data or args.prompts or args.data_batches or args.text:
        raise VerispecError("verispec train data writes to --out from --source alone (no --data, "
                            "--prompts, --data-batches or --text)")
    training = [name for name, value in (("--steps", args.steps), ("--stop-at", args.stop_at),
                                         ("--lr", args.lr), ("--batch-size", args.batch_size),
                                         ("--init", args.init)) if value is not None]
    if training:
        raise VerispecError(f"{', '.join(training)}: training options; verispec train data only "
                            "builds data (train on it with verispec train KIND --data OUT)")
    stored = stored_states(args.for_kinds, args.mid_state)
    target = load_model(args.target, args.dtype, args.device)
    build_data(target, out, args.source, args.mode, args.tokens, args.held_out,
               max_new_tokens=256 if args.max_new_tokens is None else args.max_new_tokens,
               seed=args.seed, exit_layer=args.exit_layer,
               aux_layers=aux_layers_of(target) if stored.aux else (),
               exit_states=stored.exit)
    print(f"verispec: data in {out} (held-out split: {out / HELD_OUT}); train on it with "
          f"verispec train KIND --data {out} --out DIR", file=sys.stderr)
    return 0


# The per-kind options' flags: RecipeOptions field -> argparse dest; a kind takes those it reads
# (Kind.options), and any other given is an error naming it.
KIND_FLAGS = {"heads": "heads", "draft_layers": "layers", "block": "block", "unroll": "unroll",
              "mid_state": "mid_state"}


def flag(option: str) -> str:
    """The command-line flag of a per-kind option."""
    return "--" + KIND_FLAGS[option].replace("_", "-")


def train_bytes(args: argparse.Namespace, out: Path, config) -> int:
    """`verispec train bytes`: the --target's answers, the byte model, its heads."""
    from verispec.training.bytes import HEADS_DIR, MODEL_DIR, ByteModelOptions, train_byte_model

    drafter_only = [flag for flag, value in (("--text", args.text), ("--text-data", args.text_data),
                                             ("--exit-layer", args.exit_layer),
                                             ("--init", args.init), ("--mid-state", args.mid_state))
                    if value]
    if drafter_only:
        raise VerispecError(f"{', '.join(drafter_only)}: drafter training options; the byte "
                            "model takes none of them")
    defaults = ByteModelOptions()
    options = ByteModelOptions(  # checked here, before anything loads
        hidden=args.hidden, context=args.context, attention_heads=max(1, args.hidden // 64),
        layers=defaults.layers if args.layers is None else args.layers,
        heads=defaults.heads if args.heads is None else args.heads,
        prompts=defaults.prompts if args.prompts is None else args.prompts,
        max_new_tokens=defaults.max_new_tokens if args.max_new_tokens is None else args.max_new_tokens,
        answer_batches=args.data_batches)
    writer = load_model(args.target, args.dtype, args.device)
    saved = train_byte_model(writer, out, args.data, options, config, stop_at=args.stop_at)
    heads = f"; its {options.heads} extra heads: {saved / HEADS_DIR}" if options.heads else ""
    print(f"verispec: byte model written to {saved / MODEL_DIR} (use it with --model "
          f"{saved / MODEL_DIR}){heads}", file=sys.stderr)
    return 0
