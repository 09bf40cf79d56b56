"""A drafter kind's training curve: held-out acceptance and tau against training tokens.

For each size in --sizes, trains KIND on the leading SIZE reply tokens of the data engine's
--data (its reduced vocabulary chosen on those alone; --epochs passes over them, at least
--min-steps steps), then drafts greedily for the target on the first --count prompts of the
data's held-out split (DATA/held-out: prompts the training shards never saw; never Spec-Bench),
--max-new-tokens each, and records tau (tokens per target forward) and acceptance by draft
position. Writes OUT/curve.json and OUT/curve.png (both against training tokens, log scale), and
one drafter directory per size (OUT/SIZE). Resumable: a size already in curve.json is skipped.
--init starts every size from a trained drafter (a warm start: does new data add to old?);
--mix adds whole data directories to every size (the family a warm start should not forget). The
drafter of KIND shipped for the target, where one ships, is measured on the same prompts once
(OUT/shipped.json) and drawn as a dashed line: the bar a retrained drafter must clear.

    python scripts/training_curve.py eagle3 --data runs/sharegpt-self --out runs/curve-eagle3 \\
        --sizes 30000 100000 300000 1000000 3000000 10000000
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from held_out import split_prompts

from verispec.core.files import write_json
from verispec.core.stopping import StoppingRules
from verispec.core.types import GenerationStats
from verispec.decoding.sequence import SequenceSpec
from verispec.drafters.learned import shipped_drafter
from verispec.methods import METHODS, build_engine
from verispec.model.loading import DEFAULT_MODEL, load_model
from verispec.options import DraftOptions
from verispec.training.data import load_dataset
from verispec.training.recipes import KINDS, first_tokens, train_drafter
from verispec.training.shell import RecipeOptions
from verispec.training.trainer import TrainConfig


def held_out_acceptance(target, method: str, drafter: Path, prompts: list[list[int]],
                        max_new_tokens: int) -> dict:
    """tau and acceptance by position of the trained drafter on the held-out prompts (greedy)."""
    engine = build_engine(target, method, DraftOptions(draft=str(drafter)))
    stopping = StoppingRules.build(max_new_tokens)
    stats = GenerationStats.total([engine.generate(SequenceSpec(ids, stopping)).stats for ids in prompts])
    return {"tau": stats.new_tokens / stats.target_forwards,
            "acceptance": [a / max(1, r) for a, r in zip(stats.accepted_by_position,
                                                         stats.reached_by_position)]}


def plot(points: list[dict], shipped: dict | None, kind: str, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    tokens = [p["tokens"] for p in points]
    left.plot(tokens, [p["tau"] for p in points], marker="o")
    left.set_ylabel("held-out tau (tokens per target forward)")
    for position in range(max(len(p["acceptance"]) for p in points)):
        right.plot(tokens, [p["acceptance"][position] if position < len(p["acceptance"]) else None
                            for p in points], marker="o", label=f"position {position + 1}")
    if shipped is not None:
        left.axhline(shipped["tau"], linestyle="--", color="grey", label="shipped")
        left.legend()
        for position, rate in enumerate(shipped["acceptance"][:3]):
            right.axhline(rate, linestyle="--", color=f"C{position}", alpha=0.6)
    right.set_ylabel("held-out acceptance (dashed: shipped)")
    right.set_ylim(0, 1)
    right.legend()
    for axis in (left, right):
        axis.set_xscale("log")
        axis.set_xlabel("training tokens (reply tokens)")
    fig.suptitle(f"{kind}: held-out acceptance against training data")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("kind", choices=KINDS)
    parser.add_argument("--data", required=True, help="a data engine directory (with held-out/)")
    parser.add_argument("--out", required=True)
    parser.add_argument("--sizes", type=int, nargs="+", required=True)
    parser.add_argument("--target", default=DEFAULT_MODEL)
    parser.add_argument("--epochs", type=float, default=2.0)
    parser.add_argument("--min-steps", type=int, default=200)
    parser.add_argument("--batch-size", type=int, default=TrainConfig.batch_size)
    parser.add_argument("--lr", type=float, default=TrainConfig.lr)
    parser.add_argument("--seed", type=int, default=TrainConfig.seed,
                        help="the batches' order (a continuation from --init: another seed than "
                        "the run it continues, or it replays that run's batches first)")
    parser.add_argument("--init", help="start every size from this trained drafter (same kind)")
    parser.add_argument("--mix", nargs="+", default=[], metavar="DIR",
                        help="data directories trained on in full beside each size of --data")
    parser.add_argument("--count", type=int, default=40, help="held-out prompts to draft on")
    parser.add_argument("--max-new-tokens", type=int, default=96)
    args = parser.parse_args()
    data, out = Path(args.data), Path(args.out)
    target = load_model(args.target)
    # the method that runs the kind's drafter alone (eagle-pld also runs EAGLE's, behind lookup)
    method = args.kind if args.kind in METHODS else next(
        m.name for m in METHODS.values() if m.trained_kind == args.kind)
    _, sequences = load_dataset(data)
    mix = [Path(d) for d in args.mix]
    mixed = sum(len(load_dataset(d)[1]) for d in mix)  # sequences added to every size
    prompts = split_prompts(data, args.count)
    record = out / "curve.json"
    points = json.loads(record.read_text()) if record.is_file() else []
    shipped, shipped_record = shipped_drafter(target.model, args.kind), out / "shipped.json"
    reference = None
    if shipped is not None:
        if shipped_record.is_file():
            reference = json.loads(shipped_record.read_text())
        else:
            reference = held_out_acceptance(target, method, shipped, prompts, args.max_new_tokens)
            print(json.dumps({"shipped": reference}), flush=True)
            out.mkdir(parents=True, exist_ok=True)
            write_json(shipped_record, reference)
    for size in sorted(args.sizes):
        if any(p["tokens"] == size for p in points):
            continue
        count = len(first_tokens(sequences, size)) + mixed
        steps = max(args.min_steps, math.ceil(args.epochs * count / args.batch_size))
        config = TrainConfig(steps=steps, lr=args.lr, batch_size=args.batch_size, seed=args.seed)
        drafter = train_drafter(args.kind, target, [data, *mix], out / str(size), config,
                                RecipeOptions(init=args.init), max_tokens=size)
        point = {"tokens": size, "sequences": count, "steps": steps, **({"mix": args.mix} if mix else {}),
                 **held_out_acceptance(target, method, drafter, prompts, args.max_new_tokens)}
        print(json.dumps(point), flush=True)
        points = sorted(points + [point], key=lambda p: p["tokens"])
        out.mkdir(parents=True, exist_ok=True)
        write_json(record, points)
        plot(points, reference, args.kind, out / "curve.png")


if __name__ == "__main__":
    main()
