"""Trained drafters with their decoder layer in rows.cpp's layer loop (as they draft now) against
the same drafter's layer in Python, beside ar and suffix, on held-out templated prompts (seed 785;
never Spec-Bench): the engines interleaved in one process (held_out.compare, 128 new tokens,
outputs must equal `ar`'s).

    python scripts/layer_loop.py int4 10 eagle3,eagle
"""

from __future__ import annotations

from held_out import compare, held_out, trained_arguments

from verispec.methods import build_engine


def main() -> None:
    args = trained_arguments(__doc__)
    target, prompts = held_out(args.count, 785, args.dtype)
    engines = {name: build_engine(target, name) for name in ("ar", "suffix")}
    for name in args.methods.split(","):
        engines[f"{name} (loop)"] = build_engine(target, name)
        python = build_engine(target, name)
        if python.speculation.drafter.native is None:
            raise SystemExit(f"{name}: its layer does not run in the loop on this machine")
        python.speculation.drafter.native = None
        engines[f"{name} (Python layer)"] = python
    compare(engines, prompts)


if __name__ == "__main__":
    main()
