"""Sweep tree sizes on held-out training-family prompts, never on Spec-Bench questions.

Runs each configuration (METHOD[@K]:TREE, TREE = chain or TOPKxNODES, depth K, default K the
method's; for a method that drafts behind a lookup, eagle-pld or eagle-suffix, K is the model's
depth, --model-k; METHOD:profile, the method with neither: its default, for eagle the shape this machine's
cost profile chooses) interleaved with plain decoding prompt by prompt, greedy, 128 new tokens, float32. Each
method's default tree (`--tree` without a size) is the fastest tree found here; whether a tree
beats the chain at all is the other thing it shows.

    python scripts/tune_trees.py [count=8] [seed=779] [configs=the first round's] [dtype=float32]
    python scripts/tune_trees.py 40 0 "eagle@4:chain,eagle@8:8x48" int4 --data runs/sg-teacher-bf16-3m \
        --max-new-tokens 96

(dtype int4: the 4-bit target, the GGUF's own blocks; every engine runs on that one target.
--data: the first COUNT prompts of a data directory's held-out split (`verispec train data`:
conversations no drafter trained on) instead of the seed's templated prompts; the seed is unused.)
"""

from __future__ import annotations

import argparse

from held_out import compare, drafting_options, held_out, split_prompts

from verispec.core.tree import TreeSettings
from verispec.methods import METHODS, build_engine
from verispec.model.loading import DEFAULT_MODEL, load_model

# The first round: each tree-capable method worth speculating with on a CPU, chain first.
FIRST_ROUND = ("pld:chain,pld:2x8,pld:2x12,pld:4x16,"
               "eagle:chain,eagle:2x3,eagle:2x4,eagle:4x7,eagle@3:2x5,eagle@3:3x8,eagle@4:4x12,"
               "medusa:chain,medusa:2x4,medusa:2x6,medusa:4x10,"
               "eagle-pld:chain,eagle-pld:2x3,eagle-pld:2x4,eagle-pld:4x7")


def main(count: int = 8, seed: int = 779, configs: str = FIRST_ROUND, dtype: str = "float32",
         data: str | None = None, max_new_tokens: int = 128) -> None:
    if data is None:
        target, prompts = held_out(count, seed, dtype)
    else:
        target, prompts = load_model(DEFAULT_MODEL, dtype, "cpu"), split_prompts(data, count)
    engines = {"ar": build_engine(target, "ar")}
    for config in configs.split(","):
        method_k, tree = config.split(":")
        method, _, k = method_k.partition("@")
        if tree == "profile":  # neither k nor a tree: what the method drafts by default
            engines[f"{method} (default: {tree})"] = build_engine(target, method)
            continue
        settings = None if tree == "chain" else TreeSettings(*map(int, tree.split("x")))
        options = drafting_options(method, int(k) if k else None, settings)
        engines[f"{method} k={k or METHODS[method].default_k} {tree}"] = build_engine(target, method, options)
    compare(engines, prompts, max_new_tokens)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("count", type=int, nargs="?", default=8, help="held-out prompts")
    parser.add_argument("seed", type=int, nargs="?", default=779, help="which held-out prompts")
    parser.add_argument("configs", nargs="?", default=FIRST_ROUND, help="METHOD[@K]:TREE,...")
    parser.add_argument("dtype", nargs="?", default="float32", help="the target's dtype")
    parser.add_argument("--data", help="a data directory: its held-out split's prompts")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    args = parser.parse_args()
    main(args.count, args.seed, args.configs, args.dtype, args.data, args.max_new_tokens)
