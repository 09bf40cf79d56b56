"""Choose draft lengths on held-out training-family prompts, never on Spec-Bench questions.

`eagle`: plain decoding, EAGLE at k = 2 and 3, and eagle-pld with several (lookup k, EAGLE k)
pairs. `pld`: plain decoding and prompt lookup at k = 3, 5, 7, 10 and 15. Each on `count` prompts
from verispec.training.prompts (a seed the shipped drafters were not trained with), interleaved
prompt by prompt with the order rotating, greedy, 128 new tokens, float32; prints milliseconds per
token, tau and the ratio to plain decoding. The registry's defaults (verispec.methods) come from
it (docs/tuning.md).

    python scripts/tune_draft_lengths.py [eagle|pld] [count=16] [seed=778]
"""

from __future__ import annotations

import sys

from held_out import compare, held_out

from verispec.core.policies import ConstantK
from verispec.decoding.engine import SpeculativeEngine
from verispec.drafters.hybrid import LookupThenModel
from verispec.drafters.ngram import PromptLookupDrafter
from verispec.methods import build_engine
from verispec.options import DraftOptions

PLD_KS = (3, 5, 7, 10, 15)


def main(which: str = "eagle", count: int = 16, seed: int = 778) -> None:
    if which not in ("eagle", "pld"):
        raise SystemExit(__doc__)
    target, prompts = held_out(count, seed)
    engines = {"ar": build_engine(target, "ar")}
    if which == "pld":
        engines |= {f"pld k={k}": build_engine(target, "pld", DraftOptions(k=k)) for k in PLD_KS}
    else:
        for k in (2, 3):
            engines[f"eagle k={k}"] = build_engine(target, "eagle", DraftOptions(k=k))
        for lookup_k, eagle_k in [(3, 2), (5, 2), (7, 2), (7, 3), (5, 1)]:
            drafter = LookupThenModel(PromptLookupDrafter(4, 2), build_engine(target, "eagle").drafter,
                                      eagle_k)
            engines[f"eagle-pld lookup k={lookup_k} eagle k={eagle_k}"] = SpeculativeEngine(
                target.model, drafter, ConstantK(lookup_k))
    compare(engines, prompts)


if __name__ == "__main__":
    main(*sys.argv[1:2], *(int(a) for a in sys.argv[2:4]))
