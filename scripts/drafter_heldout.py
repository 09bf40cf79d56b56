"""Held-out acceptance of trained drafters: how a drafter is chosen without Spec-Bench.

Greedy, a chain of k drafts, 96 new tokens, on prompt sets the drafters never trained on: COUNT
templated prompts from verispec.training.prompts with seed 785 that seed 0's (the training
prompts of every shipped drafter and of the data engine's templated source) do not hold, and, with
--corpus, COUNT prompts over the held-out corpus documents written by scripts/wiki_corpus.py
(summarise the passage, list its main points, or, for an article, "Tell me about TITLE.").
Prints tau and acceptance by position for each drafter directory ("shipped": the one shipped for
the built-in model). With --seen, also on COUNT seed-785 prompts that seed 0's do hold (before
2026-11-29 the templated set was seed 785's first COUNT, 15 of 20 of them seen). With --speed,
then times each drafter against plain decoding on the
templated set (held_out.compare: interleaved, 128 new tokens, outputs must equal `ar`'s, so this
is also the greedy identity check); on a shared machine read the ratios, not the milliseconds.

    python scripts/drafter_heldout.py eagle 20 shipped runs/eagle-text --k 3 \
        --corpus runs/corpus/heldout.jsonl
    python scripts/drafter_heldout.py draft 20 runs/draft-fkl runs/draft-rkl runs/draft-tvd
    python scripts/drafter_heldout.py block 20 shipped --k 2 4 7 --speed
"""

from __future__ import annotations

import argparse
import json
import random

from held_out import compare, held_out

from verispec.core.stopping import StoppingRules
from verispec.core.types import GenerationStats
from verispec.decoding.sequence import SequenceSpec
from verispec.methods import METHODS, build_engine
from verispec.options import DraftOptions
from verispec.request import encode_prompt
from verispec.training.prompts import make_prompts
from verispec.training.sources import UNSEEN_DRAW, trained_prompts


def corpus_prompts(path: str, count: int) -> list[str]:
    rng = random.Random(5)
    prompts = []
    for line in open(path, encoding="utf-8"):
        doc = json.loads(line)
        passage = " ".join(doc["text"].split()[:300])
        kinds = ["Summarize the following article in a few sentences.\n\n" + passage,
                 passage + "\n\nWhat are the main points of the passage above?"]
        if doc["title"]:
            kinds.append(f"Tell me about {doc['title']}.")
        prompts.append(rng.choice(kinds))
    return prompts[:count]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("method", choices=[m.name for m in METHODS.values() if m.trained_kind])
    parser.add_argument("count", type=int, help="prompts per set")
    parser.add_argument("drafters", nargs="+", help='trained drafter directories, or "shipped"')
    parser.add_argument("--k", type=int, nargs="+", default=[None],
                        help="draft lengths, each run in turn (default: the method's)")
    parser.add_argument("--corpus", help="held-out documents (.jsonl) for the second prompt set")
    parser.add_argument("--dtype", default="float32", help="the built-in target's dtype (default float32)")
    parser.add_argument("--seen", action="store_true",
                        help="also measure on seed-785 prompts that training saw (the gap it makes)")
    parser.add_argument("--speed", action="store_true",
                        help="then time each drafter against ar on the templated prompts")
    args = parser.parse_args()
    target, templated = held_out(args.count, 785, args.dtype)
    sets = {"templated": templated}
    if args.seen:
        trained = trained_prompts()
        seen = [p for p in make_prompts(UNSEEN_DRAW * args.count, 785) if p in trained][: args.count]
        sets["seen"] = [encode_prompt(target, p, chat=None) for p in seen]
    if args.corpus:
        sets["corpus"] = [encode_prompt(target, p, chat=True)
                          for p in corpus_prompts(args.corpus, args.count)]
    engines = {"ar": build_engine(target, "ar")}
    for path, k in [(path, k) for path in args.drafters for k in args.k]:
        options = DraftOptions(k=k, draft=None if path == "shipped" else path)
        engine = engines[f"{args.method} {path} k={k}"] = build_engine(target, args.method, options)
        for name, prompts in sets.items():
            stats = GenerationStats.total([engine.generate(SequenceSpec(ids, StoppingRules.build(96))).stats
                                           for ids in prompts])
            alpha = [round(a / max(1, r), 3)
                     for a, r in zip(stats.accepted_by_position, stats.reached_by_position)]
            print(f"{path:28s} k={k} {name:10s} tau {stats.new_tokens / stats.target_forwards:.3f} "
                  f"acceptance by position {alpha}", flush=True)
    if args.speed:
        compare(engines, templated)


if __name__ == "__main__":
    main()
