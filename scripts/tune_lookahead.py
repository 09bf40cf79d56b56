"""Sweep lookahead decoding's window W, n-gram size N and pool size G on held-out prompts.

Runs plain decoding (the baseline), prompt lookup at its default k and each lookahead setting
WxNxG (k = N - 1; a trailing "c" also pools the context's own n-grams) interleaved prompt by
prompt, greedy, float32, never on Spec-Bench questions. The method's defaults are the fastest
setting found here.

    python scripts/tune_lookahead.py [count=4] [seed=801] [new=96] [settings=FIRST_ROUND]
"""

from __future__ import annotations

import argparse

from held_out import compare, held_out

from verispec.methods import build_engine
from verispec.options import DraftOptions

FIRST_ROUND = "2x3x2,3x3x3,5x3x5,3x4x3,5x4x5,5x4x5c,7x4x7"


def main(count: int = 4, seed: int = 801, new: int = 96, settings: str = FIRST_ROUND) -> None:
    target, prompts = held_out(count, seed)
    engines = {"ar": build_engine(target, "ar"), "pld": build_engine(target, "pld")}
    for setting in settings.split(","):
        window, ngram, guesses = (int(part) for part in setting.rstrip("c").split("x"))
        options = DraftOptions(k=ngram - 1, lookahead_window=window, lookahead_ngram=ngram,
                               lookahead_guesses=guesses, lookahead_pool_context=setting.endswith("c"))
        engines[f"lookahead {setting}"] = build_engine(target, "lookahead", options)
    compare(engines, prompts, new)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("count", type=int, nargs="?", default=4, help="held-out prompts")
    parser.add_argument("seed", type=int, nargs="?", default=801, help="which held-out prompts")
    parser.add_argument("new", type=int, nargs="?", default=96, help="new tokens per prompt")
    parser.add_argument("settings", nargs="?", default=FIRST_ROUND, help="WxNxG[c],...")
    args = parser.parse_args()
    main(args.count, args.seed, args.new, args.settings)
