"""Choose the self-speculation defaults on held-out training-family prompts, never on Spec-Bench.

Runs plain decoding and the low-precision self drafters at several draft lengths (and, with
--skip, with decoder layers left out), interleaved prompt by prompt, greedy, 128 new tokens,
float32, and prints milliseconds per token, tau and the ratio to plain decoding; outputs must
equal plain decoding's. The defaults in verispec.methods.METHODS came from seeds 791 and 792:

    python scripts/tune_self.py 8 792 self-int4@8 self-int4@10 self-int4-pld@10 self-int4-pld@16
    python scripts/tune_self.py 8 793 self-int4 self-int4/skip=28,29   # layer skipping
    python scripts/tune_self.py 8 794 --dtype=int4 pld suffix self-int4-pld/skip=20,21  # 4-bit target

Each spec is METHOD[@K][/skip=I,J,...].
"""

from __future__ import annotations

import argparse

from held_out import compare, held_out

from verispec.methods import build_engine
from verispec.options import DraftOptions


def engine_for(target, spec: str):
    method, _, skip = spec.partition("/skip=")
    method, _, k = method.partition("@")
    layers = tuple(int(i) for i in skip.split(",")) if skip else ()
    return build_engine(target, method, DraftOptions(k=int(k) if k else None, skip_layers=layers))


def main(count: int, seed: int, specs: list[str], dtype: str = "float32") -> None:
    target, prompts = held_out(count, seed, dtype)
    engines = {"ar": build_engine(target, "ar")}
    engines |= {spec: engine_for(target, spec) for spec in specs}
    compare(engines, prompts)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("count", type=int, help="held-out prompts")
    parser.add_argument("seed", type=int, help="which held-out prompts")
    parser.add_argument("specs", nargs="+", help="METHOD[@K][/skip=I,J,...]")
    parser.add_argument("--dtype", default="float32", help="the target's dtype (int4: the 4-bit target)")
    args = parser.parse_args()
    main(args.count, args.seed, args.specs, args.dtype)
