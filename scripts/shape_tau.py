"""τ of each way a trained method can draft (its `Shape`s: chains and trees of each depth) with the
drafter shipped for the built-in model: the figures `auto`, `eagle`, `eagle-pld`, `eagle-suffix`
and `eagle3` choose their shape by (verispec.methods.Shape, docs/tuning.md). Rerun after
re-shipping a drafter, then paste the printed `shapes=` and digest into verispec/methods.py
(tests/test_auto.py fails until the digest matches the weights shipped).

Greedy, 128 new tokens, COUNT held-out prompts of the training family (seed 785's that seed 0's
do not hold; never Spec-Bench), τ = new tokens / target forwards on the float32 and the 4-bit
target, and their mean (the two agree within a few hundredths: a target's dtype moves few
argmaxes). τ alone needs no idle machine: the profile prices each shape on the user's CPU.

    python scripts/shape_tau.py eagle eagle-pld eagle-suffix --count 20
    python scripts/shape_tau.py eagle --shapes 1 2 3 2:2x3 3:2x5
"""

from __future__ import annotations

import argparse

from held_out import drafting_options, held_out

from verispec.core.stopping import StoppingRules
from verispec.core.tree import TreeSettings
from verispec.decoding.sequence import SequenceSpec
from verispec.drafters.learned import shipped_drafter, weights_digest
from verispec.drafters.suffix import forget_outputs
from verispec.methods import METHODS, build_engine

# Chains of depth 1-5 and the two trees of depth 2 (DEPTH:TOPKxNODES). Deeper trees (3:2x5, 3:3x8,
# 4:2x6, 4:3x10, 5:4x16) raise τ to 2.4-3.0 but measured slower than a 4-token chain on a 2-core
# EPYC, and the profile priced them as faster (docs/tuning.md, "Shapes for the drafter shipped").
CANDIDATES = ("1", "2", "3", "4", "5", "2:2x3", "2:2x4")


def parse_shape(text: str) -> tuple[int, TreeSettings | None]:
    """'3' -> a chain of depth 3; '3:2x5' -> a 2x5 tree of depth 3."""
    depth, _, tree = text.partition(":")
    return int(depth), TreeSettings(*map(int, tree.split("x"))) if tree else None


def tau(method: str, text: str, targets: dict, max_new_tokens: int) -> float:
    """Mean over the targets of τ for `method` drafting in shape `text`."""
    taus = []
    for target, prompts in targets.values():
        engine = build_engine(target, method, drafting_options(method, *parse_shape(text)))
        tokens = forwards = 0
        for ids in prompts:
            forget_outputs(engine.model)  # suffix decoding drafts from this prompt's history only
            stats = engine.generate(SequenceSpec(ids, StoppingRules.build(max_new_tokens))).stats
            tokens, forwards = tokens + stats.new_tokens, forwards + stats.target_forwards
        taus.append(tokens / forwards)
    return sum(taus) / len(taus)


def shape_code(text: str, value: float, default_k: int) -> str:
    depth, tree = parse_shape(text)
    settings = "None" if tree is None else f"TreeSettings({tree.topk}, {tree.nodes})"
    return f"Shape({settings}, {value:.2f}{'' if depth == default_k else f', {depth}'})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("methods", nargs="+", choices=[m.name for m in METHODS.values() if m.shapes])
    parser.add_argument("--shapes", nargs="+", default=CANDIDATES, help="DEPTH or DEPTH:TOPKxNODES")
    parser.add_argument("--count", type=int, default=20, help="held-out prompts")
    parser.add_argument("--seed", type=int, default=785)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    args = parser.parse_args()
    targets = {dtype: held_out(args.count, args.seed, dtype) for dtype in ("float32", "int4")}
    for method in args.methods:
        spec = METHODS[method]
        default_k = METHODS[spec.trained_kind].default_k
        codes = []
        for text in args.shapes:
            value = tau(method, text, targets, args.max_new_tokens)
            print(f"{method} {text}: τ {value:.3f}", flush=True)
            codes.append(shape_code(text, value, default_k))
        print(f"{method}: shapes=({', '.join(codes)})")
        shipped = shipped_drafter(targets["float32"][0].model, spec.trained_kind)
        print(f"measured with {spec.trained_kind} weights {weights_digest(shipped)}", flush=True)


if __name__ == "__main__":
    main()
