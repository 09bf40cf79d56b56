"""Export a stopped training run's last checkpoint as a drafter directory, with what
`verispec train` writes when a run ends (the data's metadata, the training settings, the
held-out metrics at that step and, for static-tree kinds, the rank accuracies that shape the
tree), so that a run stopped early can be evaluated and shipped like a finished one.

The run must have used the recipe's default options (the checkpoint records the training
settings, not the recipe's): a checkpoint of another shape fails to load. `--data-batches N`
reads only the first N shards of DATA (the run's data, where the directory has since grown).

    python scripts/export_checkpoint.py block runs/block-main runs/data-aux runs/block-ck800 \
        --data-batches 8
"""

from __future__ import annotations

import argparse
import tempfile
from dataclasses import asdict
from pathlib import Path

import torch

from verispec.model.loading import DEFAULT_MODEL, load_model
from verispec.training.data import load_dataset
from verispec.training.recipes import RECIPES, RecipeOptions, recipe_for, split
from verispec.training.trainer import TrainConfig


def first_shards(data: Path, count: int | None, into: Path) -> Path:
    """`data` itself, or a directory in `into` linking its metadata and first `count` shards."""
    if count is None:
        return data
    (into / "meta.json").symlink_to((data / "meta.json").resolve())
    for shard in sorted(data.glob("shard-*.pt"))[:count]:
        (into / shard.name).symlink_to(shard.resolve())
    return into


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("kind", choices=sorted(RECIPES))
    parser.add_argument("run", type=Path, help="the --out of the stopped run (holds run/checkpoint.pt)")
    parser.add_argument("data", type=Path, help="the run's --data directory")
    parser.add_argument("out", type=Path, help="where the drafter directory goes")
    parser.add_argument("--data-batches", type=int, help="the run's --data-batches")
    parser.add_argument("--eval-fraction", type=float, default=0.05)
    args = parser.parse_args()
    torch.set_num_threads(torch.get_num_threads())  # OMP_NUM_THREADS decides
    state = torch.load(args.run / "run" / "checkpoint.pt", weights_only=False, map_location="cpu")
    config = TrainConfig(**state["config"])
    target = load_model(DEFAULT_MODEL, "float32", "cpu")
    with tempfile.TemporaryDirectory() as links:
        meta, sequences = load_dataset(first_shards(args.data, args.data_batches, Path(links)))
    options = RecipeOptions()
    recipe = recipe_for(args.kind, target, meta, sequences, options)
    recipe.module.load_state_dict(state["module"])
    recipe.module.eval()
    _, eval_items = split(sequences, config.seed, args.eval_fraction)
    batches = [eval_items[i: i + config.batch_size]
               for i in range(0, len(eval_items), config.batch_size)]
    final_eval: dict[str, float] = {}
    with torch.no_grad():
        for batch in batches:
            with torch.autocast("cpu", torch.bfloat16, enabled=bool(config.bf16)):
                metrics = recipe.loss(batch, config.max_len)[1]
            for name, value in metrics.items():
                final_eval[f"eval_{name}"] = final_eval.get(f"eval_{name}", 0.0) + value / len(batches)
    extra = {"training": {"data": meta, "sequences": len(sequences), "config": asdict(config),
                          "options": asdict(options), "checkpoint_step": state["step"],
                          "final_eval": final_eval}}
    if RECIPES[args.kind].static_tree:
        with torch.no_grad():
            extra["rank_accuracy"] = recipe.rank_accuracy(eval_items, config.max_len)
    print(f"step {state['step']}: {final_eval}", flush=True)
    print(f"wrote {recipe.export(args.out, extra)}")


if __name__ == "__main__":
    main()
