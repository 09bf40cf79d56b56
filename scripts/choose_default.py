"""Choose a built-in model's default method by measurement: every method that needs no training
against plain decoding (`ar`), interleaved, on held-out prompts (verispec.training.prompts, a
seed no drafter was trained with; never the Spec-Bench questions). Outputs must be identical to
`ar`'s (held_out.compare stops otherwise), so this is also an identity check in that dtype.

    OMP_NUM_THREADS=2 python scripts/choose_default.py --model gemma3-270m --dtype float32

Prints ms per token, tau and the speedup over `ar` per method: the fixed methods' figures in
docs/tuning.md ("Default methods"). The default method is now `auto`; scripts/auto_heldout.py
holds it to these.
"""

from __future__ import annotations

import argparse

import torch

from scripts.held_out import compare, held_out
from verispec.methods import build_engine

METHODS = ("ar", "pld", "suffix", "lookahead", "self-int4", "self-int4-pld")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gemma3-270m")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--count", type=int, default=8, help="held-out prompts (default: 8)")
    parser.add_argument("--seed", type=int, default=39, help="prompt seed (training used 0)")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--methods", default=",".join(METHODS), help="ar first: the baseline")
    args = parser.parse_args()
    torch.set_num_threads(torch.get_num_threads())  # OMP_NUM_THREADS decides
    target, prompts = held_out(args.count, args.seed, args.dtype, args.model)
    engines = {method: build_engine(target, method) for method in args.methods.split(",")}
    print(f"{args.model} {args.dtype}, {len(prompts)} held-out prompts, {args.max_new_tokens} new "
          f"tokens, {torch.get_num_threads()} threads", flush=True)
    compare(engines, prompts, args.max_new_tokens)


if __name__ == "__main__":
    main()
