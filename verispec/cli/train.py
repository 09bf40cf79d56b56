"""`verispec train KIND`: self-distillation data for a target, and a drafter trained on it; or
`verispec train bytes`: verispec's byte model with its multi-token heads, from scratch."""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path

from verispec.core.errors import VerispecError
from verispec.model.loading import DEFAULT_MODEL, PRECISIONS, load_model


def add_parser(commands: argparse._SubParsersAction) -> None:
    from verispec.training.bytes import BYTE_TRAINING, BYTES_KIND, ByteModelOptions
    from verispec.training.losses import LOSSES
    from verispec.training.recipes import KINDS, RecipeOptions
    from verispec.training.trainer import TrainConfig

    bytes_ = ByteModelOptions()
    train = commands.add_parser(
        "train", help="train a drafter for a target (self-distillation), or the byte model",
        description="Builds self-distillation data (the target's own answers to generated "
        "prompts, with its hidden states; resumable) and trains a drafter on it. Writes "
        "drafter.json + weights.safetensors to --out, plus run/ (checkpoint, loss.png). "
        f"`{BYTES_KIND}` instead trains a byte-level model from scratch with multi-token heads "
        "(docs/bytes.md) on the standard library's source and the --target's answers: OUT/model "
        "(a model directory) and OUT/mtp (its heads as a drafter). Where two defaults are "
        f"given, the second is {BYTES_KIND}'s.")
    train.add_argument("kind", choices=[*KINDS, BYTES_KIND])
    train.add_argument("--target", default=DEFAULT_MODEL,
                       help=f"the model to draft for ({BYTES_KIND}: the model whose answers it reads)")
    train.add_argument("--out", required=True, help="output directory")
    train.add_argument("--data", help="data directory, shared between kinds; reused as it is once "
                       "complete (default: OUT/data)")
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
                       help=f"answer length in the data (default: 160; {bytes_.max_new_tokens})")
    train.add_argument("--steps", type=int,
                       help=f"default: {TrainConfig.steps}; {BYTE_TRAINING.steps}")
    train.add_argument("--stop-at", type=int, metavar="STEP",
                       help=f"{BYTES_KIND}: stop and export at this step of the --steps schedule "
                       "(resuming OUT/run's checkpoint: what an interrupted run reached)")
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
    train.add_argument("--block", type=int, default=RecipeOptions.block,
                       help="block drafter: rows of a block, the newest token and block - 1 "
                       "tokens drafted in one pass")
    train.add_argument("--unroll", type=int, default=RecipeOptions.unroll,
                       help="EAGLE: train on its own predictions this many steps deep")
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


def run_command(args: argparse.Namespace) -> int:
    from verispec.training.bytes import BYTE_TRAINING, BYTES_KIND
    from verispec.training.data import (
        build_dataset,
        build_text_dataset,
        is_complete,
        read_documents,
    )
    from verispec.training.recipes import RECIPES, RecipeOptions, train_drafter
    from verispec.training.trainer import TrainConfig

    byte_model = args.kind == BYTES_KIND
    defaults = BYTE_TRAINING if byte_model else TrainConfig()
    steps, lr, batch_size = (defaults.steps if args.steps is None else args.steps,
                             defaults.lr if args.lr is None else args.lr,
                             defaults.batch_size if args.batch_size is None else args.batch_size)
    if steps < 1 or batch_size < 1 or lr <= 0:
        raise VerispecError("--steps and --batch-size must be >= 1 and --lr > 0")
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise VerispecError(f"--out {out} exists and is not a directory")
    bf16 = {"auto": None, "on": True, "off": False}[args.bf16]
    if args.stop_at is not None and not (byte_model and 1 <= args.stop_at <= steps):
        raise VerispecError(f"--stop-at is a {BYTES_KIND} option and must lie in 1..--steps "
                            f"({steps}), got {args.stop_at}")
    if byte_model:
        return train_bytes(args, out, replace(defaults, steps=steps, lr=lr, batch_size=batch_size,
                                              seed=args.seed, bf16=bf16))
    recipe = RECIPES[args.kind]
    if args.mid_state and not recipe.mid_state:
        raise VerispecError(f"--mid-state is an EAGLE option; a {args.kind} drafter has no use for it")
    if args.text_data and not args.text:
        raise VerispecError("--text-data is where --text FILE's hidden states go: give --text too")
    if args.text:
        read_documents(args.text)  # a bad corpus fails here, before any data is built
    options = RecipeOptions(loss=args.loss, vocab=args.vocab,  # checked here too
                            heads=RecipeOptions.heads if args.heads is None else args.heads,
                            unroll=args.unroll, exit_layer=args.exit_layer,
                            draft_layers=RecipeOptions.draft_layers if args.layers is None else args.layers,
                            block=args.block, init=args.init, mid_state=args.mid_state)
    target = load_model(args.target, args.dtype, args.device)
    aux_layers = ()  # EAGLE-3 reads the target's states after the engines' default aux layers
    if recipe.reads_aux:
        from verispec.drafters.eagle3 import default_aux_layers

        aux_layers = default_aux_layers(target.model.config.get_text_config(decoder=True)
                                        .num_hidden_layers)
    data = Path(args.data) if args.data else out / "data"
    if is_complete(data, args.data_batches):
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
    saved = train_drafter(args.kind, target, data_dirs, out, config, options)
    print(f"verispec: {args.kind} drafter written to {saved} (loss curve: {saved / 'run' / 'loss.png'}); "
          f"use it with --method {args.kind} --draft {saved}")
    return 0


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
