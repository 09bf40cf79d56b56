"""Does EAGLE's size hold its acceptance? Trains EAGLE with DEPTH decoder layers (its own one,
then DEPTH - 1 more of the same shape) on a data engine directory for STEPS steps, and prints
the held-out top-1 agreement with the target (teacher-forced, over the split's answer positions:
`step1` is what position 1 of a draft meets, `step2` one step on from a predicted feature) and
the seconds it took. The extra layers exist only here, for training: verispec's EAGLE drafts with
one layer, and this experiment (docs/training.md, "Does a deeper EAGLE accept more?") is why.
The same runs at other settings of the one-layer drafter (`--lr`, `--feature-weight`,
`--unroll`, `--batch-size`) compare training recipes at equal steps ("What moves EAGLE at equal
steps").

    python scripts/eagle_depth.py runs/sg-teacher-bf16 runs/depth2 2 379
    python scripts/eagle_depth.py runs/sg-teacher-bf16 runs/fw0.1 1 379 --feature-weight 0.1
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace
from pathlib import Path

import torch

from verispec.drafters.eagle import EagleNet, eagle_settings
from verispec.drafters.nn import DecoderLayer
from verispec.model.loading import DEFAULT_MODEL, load_model
from verispec.training import recipes
from verispec.training.kinds import eagle
from verispec.training.shell import RecipeOptions
from verispec.training.trainer import TrainConfig


class DeepEagle(EagleNet):
    """EagleNet with depth - 1 more decoder layers after its own (training only: no cache)."""

    def __init__(self, hidden: int, heads: int, intermediate: int, depth: int) -> None:
        super().__init__(hidden, heads, intermediate)
        self.more = torch.nn.ModuleList(DecoderLayer(hidden, heads, intermediate) for _ in range(depth - 1))

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
                cache: None = None, mask: torch.Tensor | None = None,
                mid: torch.Tensor | None = None) -> torch.Tensor:
        # embeds, hidden: [batch, T, hidden] -> predicted features [batch, T, hidden]
        x = super().forward(embeds, hidden, positions, None, mask, mid)
        for layer in self.more:
            x = layer(x, positions, None, mask)
        return x


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("data", type=Path, help="a data engine directory (with held-out/)")
    parser.add_argument("out", type=Path)
    parser.add_argument("depth", type=int)
    parser.add_argument("steps", type=int)
    parser.add_argument("--lr", type=float, default=TrainConfig.lr)
    parser.add_argument("--batch-size", type=int, default=TrainConfig.batch_size)
    parser.add_argument("--feature-weight", type=float, default=RecipeOptions.feature_weight,
                        help="the feature regression's weight beside the token loss's 0.1")
    parser.add_argument("--unroll", type=int, default=RecipeOptions.unroll)
    args = parser.parse_args()
    target = load_model(DEFAULT_MODEL)
    settings = eagle_settings(target.model)
    recipes.RECIPES[eagle.KIND.name] = replace(
        eagle.KIND, build=lambda recipe, meta, sequences: (settings, DeepEagle(**settings, depth=args.depth)))
    started = time.perf_counter()
    config = TrainConfig(steps=args.steps, lr=args.lr, batch_size=args.batch_size)
    options = RecipeOptions(feature_weight=args.feature_weight, unroll=args.unroll)
    drafter = recipes.train_drafter(eagle.KIND.name, target, [args.data], args.out, config, options)
    final_eval = json.loads((drafter / "drafter.json").read_text())["training"]["final_eval"]
    params = sum(p.numel() for p in DeepEagle(**settings, depth=args.depth).parameters())
    print(json.dumps({"depth": args.depth, "steps": args.steps, "lr": args.lr,
                      "batch_size": args.batch_size, "feature_weight": args.feature_weight,
                      "unroll": args.unroll, "params": params,
                      "seconds": round(time.perf_counter() - started, 1), **final_eval}))


if __name__ == "__main__":
    main()
