"""Choose draft lengths on held-out training-family prompts, never on Spec-Bench questions.

Runs plain decoding, EAGLE at k = 2 and 3, and eagle-pld with several (lookup k, EAGLE k) pairs
on `count` prompts from verispec.training.prompts (a seed the shipped drafters were not trained
with), interleaved prompt by prompt with the order rotating, greedy, 128 new tokens, float32, and
prints milliseconds per token, tau and the ratio to plain decoding. Set EAGLE's default k from it.

    python scripts/tune_draft_lengths.py [count=16] [seed=778]
"""

from __future__ import annotations

import collections
import sys
import time

from verispec.api import encode_prompt
from verispec.drafters import DraftOptions, build_engine
from verispec.drafters.hybrid import LookupThenModel
from verispec.drafters.ngram import PromptLookupDrafter
from verispec.engine import SpeculativeEngine
from verispec.models import DEFAULT_MODEL, load_model
from verispec.policies import ConstantK
from verispec.stopping import StoppingRules
from verispec.training.prompts import make_prompts


def main(count: int = 16, seed: int = 778) -> None:
    target = load_model(DEFAULT_MODEL, "float32", "cpu")
    prompts = [encode_prompt(target, p, chat=True) for p in make_prompts(count, seed)]
    engines = {"ar": build_engine(target, "ar")}
    for k in (2, 3):
        engines[f"eagle k={k}"] = build_engine(target, "eagle", DraftOptions(k=k))
    for lookup_k, eagle_k in [(3, 2), (5, 2), (7, 2), (7, 3), (5, 1)]:
        drafter = LookupThenModel(PromptLookupDrafter(4, 2), build_engine(target, "eagle").drafter, eagle_k)
        engines[f"eagle-pld lookup k={lookup_k} eagle k={eagle_k}"] = SpeculativeEngine(
            target.model, drafter, ConstantK(lookup_k))
    names = list(engines)
    seconds, tokens, steps = collections.Counter(), collections.Counter(), collections.Counter()
    engines["ar"].generate(prompts[0], StoppingRules.build(32))  # warm-up
    for i, ids in enumerate(prompts):
        for name in names[i % len(names):] + names[: i % len(names)]:
            started = time.perf_counter()
            result = engines[name].generate(ids, StoppingRules.build(128))
            seconds[name] += time.perf_counter() - started
            tokens[name] += len(result.token_ids)
            steps[name] += len(result.steps)
    for name in names:
        print(f"{name:36s} {1000 * seconds[name] / tokens[name]:6.1f} ms/token  "
              f"tau {tokens[name] / steps[name]:.2f}  vs ar {seconds['ar'] / seconds[name]:.2f}x")


if __name__ == "__main__":
    main(*(int(a) for a in sys.argv[1:3]))
