"""Held-out acceptance of EAGLE drafters: how a retrained drafter is chosen without Spec-Bench.

Greedy, chain k = 3, 96 new tokens, on two prompt sets the drafters never trained on: N templated
prompts from verispec.training.prompts with seed 785 (training used seed 0), and N prompts over
the held-out corpus documents written by scripts/wiki_corpus.py (summarise the passage, list its
main points, or, for an article, "Tell me about TITLE."). Prints tau and acceptance by position.

    python scripts/eagle_heldout.py 20 runs/corpus/heldout.jsonl shipped runs/eagle-text
"""

from __future__ import annotations

import json
import random
import sys

from held_out import held_out

from verispec.api import encode_prompt
from verispec.drafters import DraftOptions, build_engine
from verispec.stopping import StoppingRules
from verispec.types import GenerationStats


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


def main(count: int, corpus: str, drafters: list[str]) -> None:
    target, templated = held_out(count, 785)
    sets = {"templated": templated,
            "corpus": [encode_prompt(target, p, chat=True) for p in corpus_prompts(corpus, count)]}
    for path in drafters:  # "shipped": the drafter shipped for the built-in model
        options = DraftOptions(k=3, draft=None if path == "shipped" else path)
        engine = build_engine(target, "eagle", options)
        for name, prompts in sets.items():
            stats = GenerationStats.total([engine.generate(ids, StoppingRules.build(96)).stats
                                           for ids in prompts])
            alpha = [round(a / max(1, r), 3)
                     for a, r in zip(stats.accepted_by_position, stats.reached_by_position)]
            print(f"{path:28s} {name:10s} tau {stats.new_tokens / stats.target_forwards:.3f} "
                  f"acceptance by position {alpha}", flush=True)


if __name__ == "__main__":
    if len(sys.argv) < 4:
        sys.exit(__doc__)
    main(int(sys.argv[1]), sys.argv[2], sys.argv[3:])
