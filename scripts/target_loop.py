"""A target's decoder layers in rows.cpp's layer loop (as it runs where they allow it) against the
same layers in lean.forward_rows' Python loop, in one process, alternating: one forward over 1, 4,
8 and 16 rows at 300 cached tokens, then whole answers of the given methods on held-out templated
prompts (seed 39; never Spec-Bench), whose outputs must be the same either way.

    OMP_NUM_THREADS=2 PYTHONPATH=$PWD python scripts/target_loop.py --dtype float32 --methods ar,eagle-pld
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from scripts.held_out import held_out
from verispec.core.stopping import StoppingRules
from verispec.decoding.sequence import SequenceSpec
from verispec.drafters.suffix import forget_outputs
from verispec.methods import build_engine
from verispec.model.cached_model import CachedModel, forward_rows
from verispec.model.lean import LeanWeights
from verispec.model.loading import DEFAULT_MODEL

CACHED = 300
ROWS = (1, 4, 8, 16)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--methods", default="ar", help="comma-separated (default: ar)")
    parser.add_argument("--count", type=int, default=6, help="held-out prompts (default: 6)")
    parser.add_argument("--rounds", type=int, default=25, help="forward rounds; the first 5 warm up")
    args = parser.parse_args()
    target, prompts = held_out(args.count, 39, args.dtype, args.model)
    weights = LeanWeights.of(target.model)
    loop = weights.native
    if loop is None:
        print(f"{args.model} {args.dtype}: its layers do not run in the loop on this machine")
        return 1

    def use(native: bool) -> None:
        weights.native = loop if native else None

    lm = CachedModel(target.model)
    generator = torch.Generator().manual_seed(0)
    text = torch.randint(0, target.vocab_size, (CACHED + max(ROWS),), generator=generator)
    lm.reset()
    lm.forward(text[:CACHED])
    seconds: dict[tuple[int, bool], list[float]] = {}
    for round_ in range(args.rounds):
        for rows in ROWS:
            for native in (True, False) if round_ % 2 else (False, True):
                use(native)
                started = time.perf_counter()
                forward_rows([lm], [text[CACHED:CACHED + rows]], [None])
                taken = time.perf_counter() - started
                lm.rewind(CACHED)
                if round_ >= 5:
                    seconds.setdefault((rows, native), []).append(taken)
    print(f"{args.model} {args.dtype}, {torch.get_num_threads()} threads: one forward at {CACHED} cached "
          "(ms, median), Python loop -> C++ loop")
    for rows in ROWS:
        python, native = (statistics.median(seconds[rows, flag]) for flag in (False, True))
        change = 100 * (native / python - 1)
        print(f"  {rows} rows: {python * 1e3:.2f} -> {native * 1e3:.2f} ({change:+.1f}%)")
    differing = False
    for method in args.methods.split(","):
        engine = build_engine(target, method)
        engine.generate(SequenceSpec(prompts[0], StoppingRules.build(8)))  # warm-up
        taken: dict[bool, float] = {False: 0.0, True: 0.0}
        for i, ids in enumerate(prompts):
            outputs = {}
            for native in (True, False) if i % 2 else (False, True):
                use(native)
                forget_outputs(target.model)
                started = time.perf_counter()
                outputs[native] = engine.generate(SequenceSpec(ids, StoppingRules.build(64))).token_ids
                taken[native] += time.perf_counter() - started
            differing |= outputs[True] != outputs[False]
        print(f"  {method}: {len(prompts)} answers {taken[False]:.2f} s -> {taken[True]:.2f} s "
              f"({taken[False] / taken[True]:.2f}x)")
    use(True)
    print("outputs the same either way: " + ("no" if differing else "yes"))
    return 1 if differing else 0


if __name__ == "__main__":
    sys.exit(main())
