"""Cost of the batch-invariant attention: the built-in model's lean forward over n new tokens
after 300 cached, invariant against plain (SDPA over the block), median of repeats; with
--end-to-end, ar and self-int4-pld with the invariance on and off on held-out prompts (float32).
Run: PYTHONPATH=$PWD python3 scripts/invariance_cost.py [dtype ...] | --end-to-end"""

from __future__ import annotations

import statistics
import sys
import time

import torch

from verispec.model.lean import LeanDecoder, LeanWeights
from verispec.model.loading import DEFAULT_MODEL, load_model


def timed(weights: LeanWeights, invariant: bool, n: int, repeats: int = 7) -> float:
    """Median milliseconds of one forward of n tokens after 300 cached."""
    decoder = LeanDecoder(weights, torch.device("cpu"), invariant)
    decoder.forward(torch.arange(3, 303))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        decoder.logits(decoder.forward(torch.arange(10, 10 + n))[-1:])
        times.append((time.perf_counter() - start) * 1e3)
        decoder.rewind(300)
    return statistics.median(times)


def end_to_end(count: int = 6, seed: int = 798) -> None:
    """ar and self-int4-pld, invariance on and off, interleaved on held-out prompts (one sequence
    each, so the engine's own target cache is the only one used and can be switched)."""
    from held_out import compare, held_out

    from verispec.methods import build_engine

    target, prompts = held_out(count, seed)
    engines = {}
    for method in ("ar", "self-int4-pld"):
        for invariant in (True, False):
            engine = build_engine(target, method)
            engine.target.lean = LeanDecoder(engine.target.lean.weights, engine.target.lean.device, invariant)
            engines[f"{method} invariance {'on' if invariant else 'off'}"] = engine
    compare(engines, prompts)


@torch.no_grad()
def main() -> None:
    if sys.argv[1:] == ["--end-to-end"]:
        end_to_end()
        return
    for dtype in sys.argv[1:] or ["float32", "bfloat16"]:
        weights = LeanWeights.of(load_model(DEFAULT_MODEL, dtype).model)
        for n in (1, 4, 8, 16):
            plain, invariant = timed(weights, False, n), timed(weights, True, n)
            print(f"{dtype} n={n}: plain {plain:.1f} ms, invariant {invariant:.1f} ms "
                  f"({invariant / plain:.2f}x)", flush=True)
        prompt = torch.arange(3, 303)
        for invariant in (False, True):
            decoder = LeanDecoder(weights, torch.device("cpu"), invariant)
            start = time.perf_counter()
            decoder.forward(prompt)
            print(f"{dtype} prefill 300 tokens, invariant={invariant}: "
                  f"{(time.perf_counter() - start) * 1e3:.0f} ms", flush=True)


if __name__ == "__main__":
    main()
