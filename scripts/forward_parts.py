"""Where a lean forward's time goes: products, attention, LM head, norms, rotary tables and the
rest (Python, elementwise ops, the cache), for one forward over n new tokens after a cached
context, by the CPU time of this thread (steady under a loaded machine, unlike wall time; hence
one thread: with more, the kernels' other threads' time would go uncounted).

Where the target runs its layers as one C++ call (rows.cpp's layer loop: the 4-bit, GGUF and
bfloat16 targets), the parts cannot be timed inside it: its total is the column `loop`, and the
parts are those of the same forward through the Python layers (the same kernels and bits), whose
`total` minus `loop` is what the loop saves.

    PYTHONPATH=$PWD python3 scripts/forward_parts.py int4 bfloat16 [--context 300] [--repeats 12]
    VERISPEC_KERNELS=off PYTHONPATH=$PWD python3 scripts/forward_parts.py int4   # the old kernels

Prints, per dtype, the best of `repeats` forwards for n = 1, 8, 16 (docs/kernels.md).
"""

from __future__ import annotations

import argparse
import collections
import math
import os
import time
from collections.abc import Callable

import torch
from torch import nn

from verispec.model import lean
from verispec.model.cached_model import CachedModel
from verispec.model.loading import DEFAULT_MODEL, load_model

PARTS = ("loop", "total", "products", "attention", "head", "norms", "rotary", "rest")
SIZES = (1, 8, 16)


def timed(f: Callable, spent: collections.Counter, part: str) -> Callable:
    def wrapper(*args, **kwargs):
        started = time.thread_time_ns()
        try:
            return f(*args, **kwargs)
        finally:
            spent[part] += time.thread_time_ns() - started
    return wrapper


def profile(dtype: str, context: int, repeats: int) -> dict[int, dict[str, float]]:
    """Best-of-`repeats` milliseconds per part, by tokens scored."""
    target = CachedModel(load_model(DEFAULT_MODEL, dtype).model)
    print(f"{dtype}: {target.kernel} (VERISPEC_KERNELS={os.environ.get('VERISPEC_KERNELS', 'on')})")
    weights = target.lean.weights
    native = weights.native
    spent: collections.Counter = collections.Counter()
    for layer in weights.layers:  # frozen dataclasses: their products are wrapped in place
        for name in ("qkv", "out", "gate_up", "down"):
            object.__setattr__(layer, name, timed(getattr(layer, name), spent, "products"))
        for name in ("attn_norm", "mlp_norm"):
            object.__setattr__(layer, name, timed(getattr(layer, name), spent, "norms"))
    weights.head = timed(weights.head, spent, "head")
    weights.rotary.forward = timed(weights.rotary.forward, spent, "rotary")
    saved = lean.rows.attention, lean.row_attention, nn.functional.scaled_dot_product_attention
    lean.rows.attention = timed(saved[0], spent, "attention")
    lean.row_attention = timed(saved[1], spent, "attention")
    nn.functional.scaled_dot_product_attention = timed(saved[2], spent, "sdpa")
    try:
        generator = torch.Generator().manual_seed(0)
        target.forward(torch.randint(0, 49152, (context,), generator=generator))
        best: dict[int, dict[str, float]] = {}
        for _ in range(repeats):
            for n in SIZES:
                tokens = torch.randint(0, 49152, (n,), generator=generator)
                loop = float("nan")
                if native is not None:
                    started = time.thread_time_ns()
                    target.forward(tokens)
                    loop = (time.thread_time_ns() - started) / 1e6
                    target.rewind(context)
                object.__setattr__(weights, "native", None)  # the Python layers, each part timed
                spent.clear()
                started = time.thread_time_ns()
                target.forward(tokens)
                total = time.thread_time_ns() - started
                object.__setattr__(weights, "native", native)
                target.rewind(context)
                if "attention" not in spent:  # SDPA outside row attention: the attention itself
                    spent["attention"] = spent["sdpa"]
                parts = {part: spent[part] / 1e6 for part in PARTS[2:-1]}
                parts["total"] = total / 1e6
                parts["rest"] = parts["total"] - sum(parts[p] for p in PARTS[2:-1])
                parts["loop"] = loop
                if n not in best or parts["total"] < best[n]["total"]:
                    best[n] = parts
    finally:
        lean.rows.attention, lean.row_attention, nn.functional.scaled_dot_product_attention = saved
        object.__setattr__(weights, "native", native)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("dtypes", nargs="+", choices=("float32", "bfloat16", "int4"))
    parser.add_argument("--context", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=12)
    args = parser.parse_args()
    torch.set_num_threads(1)
    for dtype in args.dtypes:
        best = profile(dtype, args.context, args.repeats)
        print("| n | " + " | ".join(PARTS) + " | vs n = 1 |")
        print("| ---: |" + " ---: |" * (len(PARTS) + 1))
        whole = "total" if math.isnan(best[1]["loop"]) else "loop"  # the forward as it runs
        for n, parts in best.items():
            print(f"| {n} | " + " | ".join("–" if math.isnan(parts[p]) else f"{parts[p]:.2f}" for p in PARTS)
                  + f" | {parts[whole] / best[1][whole]:.2f}x |")


if __name__ == "__main__":
    main()
