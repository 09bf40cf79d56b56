"""rows.attention of this checkout against that of another rows.cpp (a baseline: the parent
commit's, say), in one process, alternating call by call: a kernel change's effect measured
without the drift between processes that this project's VMs show (±10% and more). SmolLM2's
shapes (9 query heads, 3 kv heads, head_dim 64), n rows after 300, 1000 and 3000 cached keys,
float32 and bfloat16 caches; the median over rounds of each one's best of 20 calls. The two
must give the same bits (they are checked), so only speed can differ.

    mkdir -p /tmp/base; git show HEAD~1:verispec/model/kernels/rows.cpp > /tmp/base/rows.cpp
    OMP_NUM_THREADS=2 PYTHONPATH=$PWD python scripts/attention_ab.py /tmp/base/rows.cpp
"""

from __future__ import annotations

import argparse
import functools
import re
import statistics
import tempfile
import time
from pathlib import Path

import torch
from torch.utils import cpp_extension

from verispec.model.kernels import build, rows

CONTEXTS = (300, 1000, 3000)
ROWS = (1, 2, 8, 16)


def best_of(call, count: int = 20) -> float:
    best = float("inf")
    for _ in range(count):
        started = time.perf_counter()
        call()
        best = min(best, time.perf_counter() - started)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("baseline", type=Path, help="the other rows.cpp")
    parser.add_argument("--rounds", type=int, default=15)
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
    generator = torch.Generator().manual_seed(0)
    print(f"{kernel}, {torch.get_num_threads()} threads; ms a call (this checkout / baseline = ratio)")
    for dtype in (torch.float32, torch.bfloat16):
        keys, values = (torch.randn(1, 3, 3100, 64, generator=generator).to(dtype) for _ in range(2))
        print(f"\n{dtype}\ncached | " + " | ".join(f"{n} rows" for n in ROWS))
        for context in CONTEXTS:
            cells = []
            for n in ROWS:
                q = torch.randn(1, 9, n, 64, generator=generator).to(dtype)
                calls = [functools.partial(lib.attention, q, keys, values, None, context + n, 0.125, isa, 0)
                         for lib in (here, base)]
                assert torch.equal(calls[0](), calls[1]()), "the two builds give different bits"
                times: list[list[float]] = [[], []]
                for _ in range(args.rounds):
                    for which, call in enumerate(calls):
                        times[which].append(best_of(call))
                mine, theirs = (statistics.median(t) * 1e3 for t in times)
                cells.append(f"{mine:.3f} / {theirs:.3f} = {mine / theirs:.2f}")
            print(f"{context} | " + " | ".join(cells), flush=True)


if __name__ == "__main__":
    main()
