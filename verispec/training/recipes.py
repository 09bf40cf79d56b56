"""What `verispec train KIND` trains: RECIPES, every trainable drafter kind keyed by its
drafter's own `kind`, each kind one module of verispec.training.kinds on the shell
verispec.training.shell; and the run around it (data, held-out split, training, export).

A new kind is one file in verispec/training/kinds/ (its module, loss, features and the options it
reads, as a `KIND`) and one entry here.
"""

from __future__ import annotations

import json
import random
from dataclasses import asdict, replace
from pathlib import Path

import torch

from verispec.core.errors import VerispecError
from verispec.drafters.learned import CONFIG_FILE, drafter_config, load_drafter
from verispec.model.loading import LoadedModel
from verispec.training.data import Sequence, load_dataset
from verispec.training.data_engine import HELD_OUT
from verispec.training.kinds import block, draft, eagle, eagle3, early_exit, hydra, medusa, mtp
from verispec.training.shell import Kind, Recipe, RecipeOptions
from verispec.training.trainer import TrainConfig, bf16_is_fast, fit, train

# Every kind `verispec train` knows, keyed by its drafter's own `kind` (the order of the help text).
RECIPES: dict[str, Kind] = {k.name: k for k in (eagle.KIND, medusa.KIND, early_exit.KIND, draft.KIND,
                                                eagle3.KIND, hydra.KIND, mtp.KIND, block.KIND)}
KINDS = tuple(RECIPES)


def recipe_for(kind: str, target: LoadedModel, meta: dict, sequences: list[Sequence],
               options: RecipeOptions) -> Recipe:
    """The recipe of the registered kind named `kind` for this target and data."""
    if kind not in RECIPES:
        raise VerispecError(f"unknown drafter kind {kind!r}; choose from {', '.join(KINDS)}")
    return Recipe(RECIPES[kind], target, meta, sequences, options)


def split(sequences: list[Sequence], seed: int,
          eval_fraction: float) -> tuple[list[Sequence], list[Sequence]]:
    """(training, held-out) sequences: a seeded shuffle, the first eval_fraction held out."""
    order = list(range(len(sequences)))
    random.Random(seed).shuffle(order)
    held = max(1, int(len(order) * eval_fraction)) if len(order) > 1 else 0
    eval_items = [sequences[i] for i in order[:held]]
    return [sequences[i] for i in order[held:]] or eval_items, eval_items


def calibrate_medusa(drafter_dir: Path, target: LoadedModel, data_dir: Path,
                     eval_fraction: float = 0.05) -> list[list[float]]:
    """Measure a trained Medusa drafter's rank accuracies on its training run's held-out data and
    store them in its drafter.json (for drafters trained before verispec measured them itself)."""
    config = drafter_config(drafter_dir)
    kind = medusa.KIND.name
    _, weights = load_drafter(drafter_dir, target.model, kind)
    meta, sequences = load_dataset(data_dir)
    recipe = recipe_for(kind, target, meta, sequences, RecipeOptions(heads=config["settings"]["heads"]))
    recipe.module.load_state_dict(recipe.own_weights(weights))
    recipe.use_vocabulary(weights["vocab_ids"])
    train_config = config["training"]["config"]
    _, eval_items = split(sequences, train_config["seed"], eval_fraction)
    config["rank_accuracy"] = recipe.rank_accuracy(eval_items, train_config["max_len"])
    (Path(drafter_dir) / CONFIG_FILE).write_text(json.dumps(config, indent=1) + "\n")
    return config["rank_accuracy"]


def load_datasets(data_dirs: list[Path], target: LoadedModel,
                  max_tokens: int | None = None) -> tuple[dict, list[Sequence]]:
    """The sequences of every data directory, checked to be the target's states at one exit
    layer; max_tokens: of the first directory only its leading sequences holding that many reply
    tokens (the others in full: data mixed in beside a training curve's sizes). The metadata
    returned is the first directory's, with a "sources" list of them all."""
    metas, sequences = [], []
    for data_dir in data_dirs:
        meta, found = load_dataset(data_dir)
        if meta.get("hidden_size") != target.model.config.get_text_config(decoder=True).hidden_size:
            raise VerispecError(f"the data in {data_dir} was made for another target")
        if metas and meta["exit_layer"] != metas[0]["exit_layer"]:
            raise VerispecError(f"the data in {data_dir} holds layer {meta['exit_layer']} states, "
                                f"the data in {data_dirs[0]} layer {metas[0]['exit_layer']}")
        if max_tokens is not None and not metas:
            found = first_tokens(found, max_tokens)
        metas.append(meta)
        sequences += found
    return ({**metas[0], "sources": metas} if len(metas) > 1 else metas[0]), sequences


def first_tokens(sequences: list[Sequence], tokens: int) -> list[Sequence]:
    """The leading sequences that hold `tokens` reply tokens (at least one sequence)."""
    kept, total = [], 0
    for s in sequences:
        if kept and total >= tokens:
            break
        kept.append(s)
        total += len(s.tokens) - s.prompt_len
    return kept


def train_drafter(kind: str, target: LoadedModel, data_dirs: list[Path], out_dir: Path,
                  config: TrainConfig, options: RecipeOptions = RecipeOptions(),
                  eval_fraction: float = 0.05, max_tokens: int | None = None,
                  until: int | None = None) -> Path:
    """Train a drafter of `kind` on the data in data_dirs (self-distillation and corpus data
    mixed); write it (and its run files) to out_dir. Where the first directory holds a held-out
    split (the data engine's), it is the evaluation set; otherwise a seeded eval_fraction of the
    sequences is. max_tokens: read only the first directory's leading sequences holding this many
    reply tokens, and the other directories' in full (the training curve's sizes; the reduced
    vocabulary too is chosen on these alone). until: train and export only up to this step of
    config's schedule (trainer.train's until: a long run in parts)."""
    if config.bf16 is None:  # recorded as decided
        config = replace(config, bf16=bf16_is_fast(target.model.device.type))
    meta, sequences = load_datasets(data_dirs, target, max_tokens)
    held = Path(data_dirs[0]) / HELD_OUT
    if (held / "meta.json").is_file():
        train_items, eval_items = sequences, load_dataset(held)[1]
    else:
        train_items, eval_items = split(sequences, config.seed, eval_fraction)
    torch.manual_seed(config.seed)
    recipe = recipe_for(kind, target, meta, sequences, options)
    history = train(recipe.module, lambda batch: recipe.loss(batch, config.max_len), train_items,
                    eval_items, config, out_dir / "run", desc=f"train {kind}", until=until)
    final_eval = {k: v for k, v in history[-1].items() if k.startswith("eval_")}
    extra = {"training": {"data": meta, "sequences": len(sequences), "config": asdict(config),
                          "options": asdict(options), "step": history[-1]["step"],
                          "final_eval": final_eval, "fit": fit(history)}}
    if RECIPES[kind].static_tree:
        extra["rank_accuracy"] = recipe.rank_accuracy(eval_items, config.max_len)
    return recipe.export(out_dir, extra)
