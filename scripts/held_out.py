"""Shared by the tuning scripts: held-out prompts and an interleaved timing comparison.

Defaults are chosen on prompts from verispec.training.prompts with a seed the shipped drafters
were not trained with (training used seed 0), never on the Spec-Bench questions, which are for
evaluation only. A seed's prompts repeat seed 0's where a family runs out of new ones, so a
trained drafter is measured on the `unseen` ones (verispec.training.sources.unseen_prompts).
"""

from __future__ import annotations

import argparse
import collections
import time
from pathlib import Path

from verispec.core.stopping import StoppingRules
from verispec.core.tree import TreeSettings
from verispec.core.types import GenerationStats
from verispec.decoding.engine import SpeculativeEngine
from verispec.decoding.sequence import SequenceSpec
from verispec.drafters.suffix import forget_outputs
from verispec.methods import METHODS
from verispec.model.loading import DEFAULT_MODEL, LoadedModel, load_model
from verispec.options import DraftOptions
from verispec.request import encode_prompt
from verispec.training.data import load_dataset
from verispec.training.data_engine import HELD_OUT
from verispec.training.sources import unseen_prompts


def held_out(count: int, seed: int, dtype: str = "float32", model: str = DEFAULT_MODEL
             ) -> tuple[LoadedModel, list[list[int]]]:
    """A built-in target (default: the default one) in `dtype` on CPU and `count` held-out
    prompts of `seed` that the drafters' training prompts (seed 0's) do not hold, through its
    chat template where it has one (Gemma 3 270M, a base model, has none). Before 2026-11-29
    these were the seed's first `count`, and 15 of seed 785's first 20 are seed 0's too."""
    target = load_model(model, dtype, "cpu")
    return target, [encode_prompt(target, p, chat=None) for p in unseen_prompts(count, seed)]


def split_prompts(data: str | Path, count: int) -> list[list[int]]:
    """The first `count` prompts (token ids) of a data directory's held-out split (`verispec
    train data`: conversations no drafter trained on)."""
    _, held = load_dataset(Path(data) / HELD_OUT)
    return [sequence.tokens[: sequence.prompt_len].tolist() for sequence in held[:count]]


def drafting_options(method: str, depth: int | None, tree: TreeSettings | None) -> DraftOptions:
    """Options drafting `method` as a chain or `tree` of `depth` (None: the method's k); behind a
    lookup (eagle-pld, eagle-suffix) the depth is the model's (--model-k), the lookup's k its own."""
    spec = METHODS[method]
    if spec.trained_kind not in (None, method):
        return DraftOptions(k=spec.default_k, tree=tree, model_k=depth)
    return DraftOptions(k=spec.default_k if depth is None else depth, tree=tree)


def trained_arguments(doc: str) -> argparse.Namespace:
    """The arguments of a script comparing trained methods: the built-in target's dtype, how many
    held-out prompts, and the methods (comma-separated)."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("dtype", help="the built-in target's dtype (float32, int4, ...)")
    parser.add_argument("count", type=int, help="held-out prompts")
    parser.add_argument("methods", help="trained methods, comma-separated")
    return parser.parse_args()


def compare(engines: dict[str, SpeculativeEngine], prompts: list[list[int]],
            max_new_tokens: int = 128) -> None:
    """Run every engine on every prompt, greedy, the order rotating per prompt so that the
    machine's drifts in speed fall on all alike; print ms per token, tau and the ratio to the
    first engine (the baseline), the draft and verification milliseconds per step that drafted,
    and the acceptance at draft positions 1-3 (kept among the steps that reached the position;
    in a tree, any child kept). Outputs must equal the baseline's: a difference is an error."""
    names = list(engines)
    stats: dict[str, list[GenerationStats]] = collections.defaultdict(list)
    seconds, tokens, steps = collections.Counter(), collections.Counter(), collections.Counter()
    drafting, draft_seconds, verify_seconds = (collections.Counter(), collections.Counter(),
                                               collections.Counter())
    engines[names[0]].generate(SequenceSpec(prompts[0], StoppingRules.build(32)))  # warm-up
    for i, ids in enumerate(prompts):
        outputs = {}
        for name in names[i % len(names):] + names[: i % len(names)]:
            forget_outputs(engines[name].model)  # suffix must not draft from another engine's answer
            started = time.perf_counter()
            result = engines[name].generate(SequenceSpec(ids, StoppingRules.build(max_new_tokens)))
            seconds[name] += time.perf_counter() - started
            tokens[name] += len(result.token_ids)
            steps[name] += len(result.steps)
            drafted = [step for step in result.steps if step.num_drafted]
            drafting[name] += len(drafted)
            draft_seconds[name] += sum(step.draft_seconds for step in drafted)
            verify_seconds[name] += sum(step.verify_seconds for step in drafted)
            outputs[name] = result.token_ids
            stats[name].append(result.stats)
        differing = [name for name in names if outputs[name] != outputs[names[0]]]
        if differing:
            raise SystemExit(f"prompt {i}: {', '.join(differing)} differ from {names[0]}")
        print(f"prompt {i + 1}/{len(prompts)} done", flush=True)
    base = names[0]
    for name in names:
        per_step = ""
        if drafting[name]:
            kept = GenerationStats.total(stats[name]).acceptance_by_position[:3]
            per_step = (f"  draft {1000 * draft_seconds[name] / drafting[name]:.1f} / verify "
                        f"{1000 * verify_seconds[name] / drafting[name]:.1f} ms a drafting step"
                        f"  acceptance {' / '.join(f'{rate:.2f}' for rate in kept)}")
        print(f"{name:40s} {1000 * seconds[name] / tokens[name]:6.1f} ms/token  "
              f"tau {tokens[name] / steps[name]:.2f}  vs {base} {seconds[base] / seconds[name]:.2f}x"
              f"{per_step}", flush=True)
