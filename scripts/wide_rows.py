"""Few rows padded to four against narrow passes: the same engines, end to end, interleaved.

A float32 target's invariant passes of fewer than lean.WIDE_ROWS rows pad them where this machine
streams the model's products faster so (lean.wide_pays, at load). This times each method with
the padding on and off (LeanWeights.min_rows switched between prompts, the order alternating) on
held-out prompts of the training family (seed 39; never Spec-Bench), greedy, and checks every
output is the same both ways and, for a speculative method, the same as `ar`'s.

    OMP_NUM_THREADS=2 PYTHONPATH=$PWD python scripts/wide_rows.py --methods ar,suffix,eagle
    OMP_NUM_THREADS=2 PYTHONPATH=$PWD python scripts/wide_rows.py --model gemma3-270m --count 4
"""

from __future__ import annotations

import argparse
import time

from scripts.held_out import held_out
from verispec.core.stopping import StoppingRules
from verispec.decoding.sequence import SequenceSpec
from verispec.drafters.suffix import forget_outputs
from verispec.methods import PLAIN, build_engine
from verispec.model.lean import ROLES, WIDE_ROWS, LeanWeights
from verispec.model.loading import DEFAULT_MODEL


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--methods", default="ar,suffix")
    parser.add_argument("--count", type=int, default=6, help="held-out prompts (default: 6)")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    args = parser.parse_args()
    target, prompts = held_out(args.count, 39, "float32", args.model)
    weights = LeanWeights.of(target.model)
    print(f"{args.model} float32: chosen at load {weights.min_rows}", flush=True)
    ways = {"narrow": {role: 2 if role in weights.paired else 1 for role in ROLES},
            "wide": dict.fromkeys(ROLES, WIDE_ROWS)}
    methods = args.methods.split(",")
    engines = {method: build_engine(target, method) for method in methods}
    seconds = {(method, way): 0.0 for method in methods for way in ways}
    for i, ids in enumerate(prompts):
        outputs = {}
        for method in methods:
            for way in list(ways)[:: 1 if i % 2 == 0 else -1]:
                weights.min_rows = ways[way]
                forget_outputs(target.model)  # suffix must not draft from the other way's answer
                started = time.perf_counter()
                result = engines[method].generate(SequenceSpec(ids, StoppingRules.build(args.max_new_tokens)))
                seconds[(method, way)] += time.perf_counter() - started
                outputs[(method, way)] = result.token_ids
        reference = outputs.get((PLAIN, "narrow"), outputs[(methods[0], "narrow")])
        differing = sorted({method for (method, _), tokens in outputs.items() if tokens != reference})
        if differing:
            raise SystemExit(f"prompt {i}: {', '.join(differing)} differ")
        print(f"prompt {i + 1}/{len(prompts)} done", flush=True)
    for method in methods:
        narrow, wide = seconds[(method, "narrow")], seconds[(method, "wide")]
        print(f"{method:15s} narrow {narrow:.2f} s  wide {wide:.2f} s  wide {narrow / wide:.3f}x")


if __name__ == "__main__":
    main()
