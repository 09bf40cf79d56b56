"""rows.cpp's kernels in this checkout against those of another rows.cpp (a baseline: the parent
commit's, say), in one process, alternating call by call: a kernel change's effect measured
without the drift between processes that this project's VMs show (±10% and more). Products: a
SmolLM2 layer's shapes and its LM head, 4-bit g32 codes with minimums (the built-in model's kind)
and packed bfloat16, at 1, 2, 8 and 16 rows; attention: SmolLM2's heads (9 query, 3 kv, head_dim
64), n rows after 300, 1000 and 3000 cached keys, float32 and bfloat16 caches. Each figure is the
median over rounds of each build's best of a few calls; the two builds must give the same bits
(checked), so only speed can differ.

    mkdir -p /tmp/base; git show HEAD~1:verispec/model/kernels/rows.cpp > /tmp/base/rows.cpp
    OMP_NUM_THREADS=2 PYTHONPATH=$PWD python scripts/kernel_ab.py /tmp/base/rows.cpp [--only products]
"""

from __future__ import annotations

import argparse
import functools
import re
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch.utils import cpp_extension

from scripts.product_times import SHAPES  # [out, in]: q/k/v, gate/up, down, head
from verispec.model.kernels import build, rows

PRODUCT_ROWS = (1, 2, 8, 16)
CONTEXTS = (300, 1000, 3000)
ATTENTION_ROWS = (1, 2, 8, 16)


def best_of(call: Callable[[], object], count: int) -> float:
    best = float("inf")
    for _ in range(count):
        started = time.perf_counter()
        call()
        best = min(best, time.perf_counter() - started)
    return best


def compare(calls: list[Callable[[], torch.Tensor]], rounds: int, count: int, new_bits: bool = False) -> str:
    """'mine / theirs = ratio' in ms, after checking the two calls give the same bits (or, where
    the change is one of arithmetic, saying how far apart they are)."""
    mine_out, theirs_out = calls[0](), calls[1]()
    apart = ""
    if new_bits:
        scale = theirs_out.abs().max().item() or 1.0
        apart = f" (apart {(mine_out - theirs_out).abs().max().item() / scale:.1e} of the largest)"
    else:
        assert torch.equal(mine_out, theirs_out), "the two builds give different bits"
    times: list[list[float]] = [[], []]
    for _ in range(rounds):
        for which, call in enumerate(calls):
            times[which].append(best_of(call, count))
    mine, theirs = (statistics.median(t) * 1e3 for t in times)
    return f"{mine:.3f} / {theirs:.3f} = {mine / theirs:.2f}{apart}"


def products(libraries: tuple, isa: int, rounds: int, new_bits: bool) -> None:
    generator = torch.Generator().manual_seed(0)
    print("\nproducts (4-bit g32 with minimums; bfloat16)\nshape | rows | 4-bit | bfloat16")
    for out_features, in_features in SHAPES:
        weights = rows.CodesProduct(torch.randint(0, 16, (out_features, in_features), generator=generator),
                                    torch.rand(out_features, in_features // 32, generator=generator),
                                    torch.rand(out_features, in_features // 32, generator=generator))
        dense = rows.DenseProduct(torch.randn(out_features, in_features, generator=generator))
        count = 3 if out_features > 10_000 else 20
        for n in PRODUCT_ROWS:
            x = torch.randn(n, in_features, generator=generator)
            w = weights
            codes = compare([functools.partial(lib.linear_codes, x, w.codes, w.scales, w.mins, w.group,
                                               w.nibbles, out_features, isa) for lib in libraries],
                            rounds, count, new_bits)
            packed = compare([functools.partial(lib.linear_dense, x, dense.packed, out_features, False, isa)
                              for lib in libraries], rounds, count)
            print(f"{out_features}x{in_features} | {n} | {codes} | {packed}", flush=True)


def attention(libraries: tuple, isa: int, rounds: int) -> None:
    generator = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        keys, values = (torch.randn(1, 3, 3100, 64, generator=generator).to(dtype) for _ in range(2))
        print(f"\nattention, {dtype}\ncached | " + " | ".join(f"{n} rows" for n in ATTENTION_ROWS))
        for context in CONTEXTS:
            cells = []
            for n in ATTENTION_ROWS:
                q = torch.randn(1, 9, n, 64, generator=generator).to(dtype)
                calls = [functools.partial(lib.attention, q, keys, values, None, context + n, 0.125, isa, 0)
                         for lib in libraries]
                cells.append(compare(calls, rounds, 20))
            print(f"{context} | " + " | ".join(cells), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("baseline", type=Path, help="the other rows.cpp")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--only", choices=("products", "attention"))
    parser.add_argument("--new-bits", action="store_true",
                        help="the 4-bit products' arithmetic changed: say how far apart, not the same bits")
    args = parser.parse_args()
    kernel = rows.choice().name
    isa = rows.isa(kernel)
    here = build.library()
    with tempfile.TemporaryDirectory() as directory:
        # Its classes kept to its own module: pybind11 registers a class once a process.
        source = Path(directory) / "rows.cpp"
        local = r'class_<\1>(module, "\2", pybind11::module_local())'
        source.write_text(re.sub(r'class_<(\w+)>\(module, "(\w+)"\)', local, args.baseline.read_text()))
        base = cpp_extension.load(name="baseline_rows", sources=[str(source)], build_directory=directory,
                                  extra_cflags=build.flags(), extra_ldflags=["-fopenmp"], verbose=False)
    print(f"{kernel}, {torch.get_num_threads()} threads; ms a call: this checkout / baseline = ratio")
    if args.only != "attention":
        products((here, base), isa, args.rounds, args.new_bits)
    if args.only != "products":
        attention((here, base), isa, args.rounds)


if __name__ == "__main__":
    main()
