"""Hold `auto` to the fixed methods: `ar`, `auto` and every fixed method that needs no training
or whose trained drafter ships for the target, interleaved, greedy, on held-out prompts of the
training family (scripts/held_out.py: a seed's templated prompts that no drafter trained on;
never the Spec-Bench questions).

    OMP_NUM_THREADS=2 PYTHONPATH=$PWD python scripts/auto_heldout.py --dtype float32

Prints the profile auto decides by (measured again first), then per prompt each method's speed
against `ar` (auto's first; with --repeats N, each time the least of N rounds: on a shared VM
another process only ever slows a round down), overall auto against the best fixed method,
whether every output equals `ar`'s, what auto chose, how its target's forwards ran against the
profile (auto.Pace), what a step cost besides and how many trials it drafted; then
the issue's bar (auto >= 0.97x ar on every prompt, >= 0.95x the best fixed method overall, every
output identical): PASS or FAIL. Exit status 1 where an output differs from ar's.
"""

from __future__ import annotations

import argparse
import collections
import sys
import time

import torch

from scripts.held_out import held_out
from verispec.core.errors import VerispecError
from verispec.core.stopping import StoppingRules
from verispec.decoding.sequence import SequenceSpec
from verispec.drafters.suffix import forget_outputs
from verispec.methods import auto_profile, build_engine
from verispec.model.loading import DEFAULT_MODEL
from verispec.profile import profile_table

FIXED = ("pld", "suffix", "self-int4", "self-int8", "self-bf16", "self-int4-pld", "self-int8-pld",
         "eagle", "eagle-pld", "eagle-suffix")
PER_PROMPT_BAR = 0.97  # auto / ar on every prompt, at least
BEST_BAR = 0.95  # auto / the best fixed method overall, at least


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--count", type=int, default=8, help="held-out prompts (default: 8)")
    parser.add_argument("--seed", type=int, default=39, help="prompt seed (training used 0)")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--methods", default=",".join(FIXED), help="the fixed methods to compare")
    parser.add_argument("--repeats", type=int, default=1,
                        help="rounds over the prompts; each method's time on a prompt is its least "
                             "(default: 1; on a cheap target a round moves by several percent)")
    parser.add_argument("--fresh", action="store_true",
                        help="a new auto for every answer, as each `verispec generate` command gets: "
                             "nothing learnt from earlier answers (the profile stays)")
    args = parser.parse_args()
    target, prompts = held_out(args.count, args.seed, args.dtype, args.model)
    print(f"{args.model} {args.dtype}, {len(prompts)} held-out prompts (seed {args.seed}), "
          f"{args.max_new_tokens} new tokens, {torch.get_num_threads()} threads", flush=True)
    # measured now, on this run's machine as it is (the cached one may be from a busier moment)
    print(profile_table(auto_profile(target, refresh=True)), flush=True)
    engines = {"ar": build_engine(target, "ar"), "auto": build_engine(target, "auto")}
    for method in args.methods.split(","):
        try:
            engines[method] = build_engine(target, method)
        except VerispecError as error:
            print(f"{method}: skipped ({error})")
    for engine in engines.values():  # warm-up
        engine.generate(SequenceSpec(prompts[0], StoppingRules.build(16)))
    names = list(engines)
    seconds: dict[str, list[float]] = {name: [] for name in names}
    chose: collections.Counter = collections.Counter()
    differing: list[str] = []
    for i, ids in enumerate(prompts):
        outputs = {}
        rounds: dict[str, list[float]] = {name: [] for name in names}
        for repeat in range(args.repeats):
            turn = i + repeat
            for name in names[turn % len(names):] + names[: turn % len(names)]:
                if name == "auto" and args.fresh:
                    engines[name] = build_engine(target, "auto")
                forget_outputs(target.model)  # suffix must not draft from another engine's answer
                started = time.perf_counter()
                result = engines[name].generate(SequenceSpec(ids, StoppingRules.build(args.max_new_tokens)))
                rounds[name].append(time.perf_counter() - started)
                outputs[name] = result.token_ids
                if name == "auto" and repeat == 0:
                    ends = [start for start, _, _ in result.stats.choices[1:]] + [len(result.token_ids)]
                    for (start, method, _), end in zip(result.stats.choices, ends):
                        chose[method] += end - start
        for name in names:
            seconds[name].append(min(rounds[name]))
        differing += [f"prompt {i + 1}: {name}" for name in names if outputs[name] != outputs["ar"]]
        ratios = "  ".join(f"{name} {seconds['ar'][i] / seconds[name][i]:.2f}x" for name in names[1:])
        print(f"prompt {i + 1}/{len(prompts)}: ar {1000 * seconds['ar'][i] / len(outputs['ar']):.1f} "
              f"ms/token; {ratios}", flush=True)
    total = {name: sum(values) for name, values in seconds.items()}
    fixed = [name for name in names if name not in ("ar", "auto")]
    best = min(fixed, key=total.get) if fixed else "ar"
    worst_prompt = min(ar / auto for ar, auto in zip(seconds["ar"], seconds["auto"]))
    print("overall vs ar: " + ", ".join(f"{name} {total['ar'] / total[name]:.2f}x" for name in names[1:]))
    print(f"auto vs the best fixed method ({best}): {total[best] / total['auto']:.2f}x; "
          f"auto's worst prompt vs ar: {worst_prompt:.2f}x")
    print("auto chose (tokens): " + ", ".join(f"{m} {n}" for m, n in chose.most_common()))
    auto = engines["auto"].drafter
    print("auto's forwards against the profile's T(rows) at the end: " + ", ".join(
        f"{rows} rows {auto.pace(rows):.2f}" for rows in sorted(auto.pace.counts))
          + f"; a step's overhead {1000 * auto.overhead:.2f} ms")
    print(f"auto's trials of a drafter priced under the step chosen: {auto.trials[0]}, "
          f"{auto.trials[1]} of them with their first token kept")
    print("outputs identical to ar's: " + ("yes, every one" if not differing else ", ".join(differing)))
    passed = (worst_prompt >= PER_PROMPT_BAR and total[best] / total["auto"] >= BEST_BAR
              and not differing)
    print(f"bar (>= {PER_PROMPT_BAR}x ar per prompt, >= {BEST_BAR}x best fixed, identical): "
          f"{'PASS' if passed else 'FAIL'}")
    return 1 if differing else 0


if __name__ == "__main__":
    sys.exit(main())
