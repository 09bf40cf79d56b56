"""The row kernels' products alone: microseconds of a SmolLM2 layer's product shapes and its LM
head, 4-bit g32 codes and bfloat16 weights, at 1, 2, 3, 4, 8 and 16 rows, on the class this process
runs (VERISPEC_KERNELS forces one). The least of nine rounds: a kernel change is compared by
running this in a clone of the parent and in the working tree, alternately (docs/kernels.md).

    VERISPEC_KERNELS=avx2 PYTHONPATH=$PWD python3 scripts/product_times.py
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from functools import partial

import torch

from verispec.model.kernels.rows import CodesProduct, DenseProduct, choice

SHAPES = ((960, 576), (3072, 576), (576, 1536), (49152, 576))  # [out, in]: q/k/v, gate/up, down, head
ROWS = (1, 2, 3, 4, 8, 16)


def least_seconds(call: Callable[[], object], calls: int, rounds: int = 9) -> float:
    for _ in range(5):
        call()
    times = []
    for _ in range(rounds):
        started = time.perf_counter()
        for _ in range(calls):
            call()
        times.append((time.perf_counter() - started) / calls)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=9, help="rounds per figure; the least is kept")
    args = parser.parse_args()
    torch.manual_seed(0)
    print(f"class: {choice().name}")
    for out_features, in_features in SHAPES:
        groups = in_features // 32
        codes = CodesProduct(torch.randint(0, 16, (out_features, in_features)),
                             torch.rand(out_features, groups), torch.rand(out_features, groups))
        dense = DenseProduct(torch.randn(out_features, in_features))
        calls = 10 if out_features > 10_000 else 100
        for rows in ROWS:
            x = torch.randn(rows, in_features)
            times = [least_seconds(partial(product, x), calls, args.rounds) * 1e6
                     for product in (codes, dense)]
            print(f"{out_features}x{in_features} rows {rows:2d}: 4-bit {times[0]:7.0f} us  "
                  f"bfloat16 {times[1]:7.0f} us", flush=True)

if __name__ == "__main__":
    main()
