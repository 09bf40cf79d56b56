"""Replay lookup drafters, and `auto`'s rule among them, over fixed greedy outputs: no timing noise.

Greedy decoding is exact, so every method's output is `ar`'s: decode each held-out prompt once
with `ar`, then replay a drafter step by step over that output. Each step it proposes on the
committed context, keeps the draft's leading tokens that the known output repeats, and is charged
the cost profile's T(rows) for its verify plus the drafter's own measured wall time. Two rules
for choosing among lookups can then be compared on the same tokens, where a timed run of 8
prompts moves by several percent from one run to the next (docs/tuning.md, "auto").

    OMP_NUM_THREADS=2 PYTHONPATH=$PWD python scripts/auto_replay.py --dtype int4

Prints, per method: tau (tokens per verify), the modelled milliseconds per token, and the
drafter's milliseconds per step. `auto-lookups` is `auto` with its lookups alone (a self-drafter
needs the target's cache, which a replay does not run). Held-out prompts of the training family
(seed 39), never the Spec-Bench questions.
"""

from __future__ import annotations

import argparse
import copy
import time

import torch

from scripts.held_out import held_out
from verispec.core.policies import SCHEDULES
from verispec.core.stopping import StoppingRules
from verispec.core.types import SamplingParams
from verispec.decoding.sequence import SequenceSpec
from verispec.drafters.auto import AutoDrafter, CostProfile
from verispec.drafters.base import Drafter, DraftRequest
from verispec.drafters.suffix import forget_outputs
from verispec.methods import AUTO_LOOKUPS, METHODS, PLAIN, _auto_candidates, auto_profile, build_engine
from verispec.model.loading import DEFAULT_MODEL, LoadedModel
from verispec.options import DraftOptions

AUTO_LOOKUPS_ONLY = "auto-lookups"
REPLAYED = ("suffix", "pld", AUTO_LOOKUPS_ONLY)  # lookups: they read nothing but the tokens


def drafter_for(target: LoadedModel, method: str, profile: CostProfile) -> tuple[Drafter, object]:
    """The drafter and draft-length policy a method decodes with (auto: its lookups alone)."""
    if method == AUTO_LOOKUPS_ONLY:
        builders, limits = _auto_candidates(target, DraftOptions())
        lookups = {name: builders[name]() for name in AUTO_LOOKUPS}
        options = DraftOptions()
        policy = SCHEDULES[options.schedule](METHODS["auto"].default_k)  # auto's, without its self-drafter
        return AutoDrafter(profile, lookups, {}, limits, PLAIN), policy
    engine = build_engine(target, method)
    return engine.speculation.drafter, engine.speculation.policy


def replay(drafter: Drafter, policy, profile: CostProfile, prompts: list[list[int]],
           outputs: list[list[int]], model) -> tuple[float, float, float]:
    """(tau, modelled seconds per token, drafter seconds per step) over every prompt."""
    seconds = drafting = 0.0
    steps = tokens = 0
    for prompt, output in zip(prompts, outputs):
        forget_outputs(model)
        drafter.reset()
        policy = copy.deepcopy(policy)
        context, at = list(prompt), 0
        while at < len(output):
            k = min(policy.next_k(), len(output) - at - 1)  # the last token is the target's own
            started = time.perf_counter()
            draft: list[int] = []
            kept = 0
            if k > 0:
                request = DraftRequest(torch.tensor(context), k, SamplingParams(), None)
                draft = drafter.propose(request).tokens.tolist()
                for drafted, said in zip(draft, output[at:]):
                    if drafted != said:
                        break
                    kept += 1
                drafter.commit(kept)
            drafting += time.perf_counter() - started
            policy.update(len(draft), kept)
            seconds += profile.forward_seconds(len(draft) + 1)
            steps += 1
            tokens += kept + 1
            context += output[at:at + kept + 1]
            at += kept + 1
    return tokens / steps, (seconds + drafting) / tokens, drafting / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--dtype", default="int4")
    parser.add_argument("--count", type=int, default=8, help="held-out prompts (default: 8)")
    parser.add_argument("--seed", type=int, default=39, help="prompt seed (training used 0)")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--methods", default=",".join(REPLAYED))
    args = parser.parse_args()
    target, prompts = held_out(args.count, args.seed, args.dtype, args.model)
    profile = auto_profile(target)
    ar = build_engine(target, "ar")
    stopping = StoppingRules.build(args.max_new_tokens)
    outputs = [ar.generate(SequenceSpec(p, stopping)).token_ids for p in prompts]
    print(f"{args.model} {args.dtype}, {len(prompts)} held-out prompts (seed {args.seed}), "
          f"{args.max_new_tokens} new tokens, {torch.get_num_threads()} threads; "
          f"profile T(1) {1e3 * profile.forward_seconds(1):.2f} ms")
    for method in args.methods.split(","):
        if method not in REPLAYED:
            raise SystemExit(f"{method}: only {', '.join(REPLAYED)} replay "
                             "(the others read the target's states or cache)")
        drafter, policy = drafter_for(target, method, profile)
        tau, per_token, per_step = replay(drafter, policy, profile, prompts, outputs, target.model)
        print(f"{method:14s} tau {tau:.3f}  modelled {1e3 * per_token:.3f} ms/token  "
              f"drafter {1e3 * per_step:.3f} ms/step", flush=True)


if __name__ == "__main__":
    main()
