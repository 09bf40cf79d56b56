"""Trained drafters drafting at full precision (as before 2026-11-28) against in 8-bit groups (as
now), beside ar, pld and suffix, on held-out templated prompts (seed 785; never Spec-Bench): the
engines interleaved in one process (held_out.compare, 128 new tokens, outputs must equal `ar`'s).

    python scripts/drafting_precision.py int4 10 eagle,eagle3,eagle-pld
"""

from __future__ import annotations

import weakref

from held_out import compare, held_out, trained_arguments

from verispec.drafters import learned
from verispec.methods import build_engine


def main() -> None:
    args = trained_arguments(__doc__)
    target, prompts = held_out(args.count, 785, args.dtype)
    engines = {name: build_engine(target, name) for name in ("ar", "pld", "suffix")}
    methods = args.methods.split(",")
    eight_bits = learned.draft_in_8_bits
    learned.draft_in_8_bits = lambda module: False  # the drafters built now keep float products
    for name in methods:
        engines[f"{name} (float)"] = build_engine(target, name)
    learned.draft_in_8_bits = eight_bits
    learned._HEADS = weakref.WeakKeyDictionary()  # the heads above were made at full precision
    for name in methods:
        engines[f"{name} (8-bit)"] = build_engine(target, name)
    compare(engines, prompts)


if __name__ == "__main__":
    main()
