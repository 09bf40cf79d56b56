"""What lossy distance acceptance ("tv:X") costs in quality for what it gains in speed.

Samples held-out prompts (verispec.training.sources.unseen_prompts: templated, none of the
drafters' training prompts; never Spec-Bench) with the built-in float32
target and one method, under exact acceptance and under tv:X for several X, interleaved prompt by
prompt with the same seeds. Speed: seconds against exact sampling, and τ. Quality: the target's
own mean log-probability per generated token of the outputs (its warped distribution, scored by
one float32 forward over prompt + output), against exact sampling's: exact samples are the
target's law, so a rule that drifts from it shows as a different likelihood. Writes the table,
JSON and one plot (speedup against log-likelihood, a point per X).

Run: PYTHONPATH=$PWD python3 scripts/lossy_curve.py OUT_DIR [method] [prompts] [seed]
(e.g. docs/img eagle 8 797).
"""

from __future__ import annotations

import argparse
import json
import time
from collections import Counter
from pathlib import Path

import matplotlib
import torch

from verispec.core.sampling import warp_probs
from verispec.core.stopping import StoppingRules
from verispec.core.types import SamplingParams
from verispec.decoding.sequence import SequenceSpec
from verispec.methods import build_engine
from verispec.model.loading import DEFAULT_MODEL, load_model
from verispec.options import DraftOptions
from verispec.request import encode_prompt
from verispec.training.sources import unseen_prompts

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

RULES = ("exact", "tv:0.05", "tv:0.1", "tv:0.2", "tv:0.4")
SAMPLING = SamplingParams(do_sample=True, temperature=0.7)
NEW = 96
SAMPLES = 3  # seeds per prompt


@torch.inference_mode()
def log_likelihood(model: torch.nn.Module, prompt: list[int], output: list[int]) -> float:
    """Sum of the target's warped log-probabilities of `output` after `prompt`."""
    if not output:
        return 0.0
    logits = model(torch.tensor([prompt + output])).logits[0, len(prompt) - 1: -1]  # [len(output), V]
    probs = warp_probs(logits, SAMPLING)
    return float(probs[torch.arange(len(output)), torch.tensor(output)].clamp_min(1e-30).log().sum())


def main(out_dir: str, method: str = "eagle", count: int = 8, seed: int = 797) -> None:
    target = load_model(DEFAULT_MODEL, "float32")
    prompts = [encode_prompt(target, p, chat=True) for p in unseen_prompts(count, seed)]
    engines = {rule: build_engine(target, method, DraftOptions(acceptance=rule)) for rule in RULES}
    engines["exact"].generate(SequenceSpec(prompts[0], StoppingRules.build(16), SAMPLING, 0))  # warm-up
    seconds, tokens, forwards, likelihood = Counter(), Counter(), Counter(), Counter()
    for index, prompt in enumerate(prompts):
        for sample in range(SAMPLES):
            order = RULES[index % len(RULES):] + RULES[: index % len(RULES)]
            for rule in order:
                started = time.perf_counter()
                result = engines[rule].generate(
                    SequenceSpec(prompt, StoppingRules.build(NEW), SAMPLING,
                                 seed * 1000 + index * SAMPLES + sample))
                seconds[rule] += time.perf_counter() - started
                tokens[rule] += len(result.token_ids)
                forwards[rule] += result.stats.target_forwards
                likelihood[rule] += log_likelihood(target.model, prompt, result.token_ids)
        print(f"prompt {index + 1}/{count} done", flush=True)
    rows = []
    per_token = {rule: seconds[rule] / tokens[rule] for rule in RULES}
    for rule in RULES:
        rows.append({"rule": rule, "seconds": seconds[rule], "tokens": tokens[rule],
                     "speedup_vs_exact": per_token["exact"] / per_token[rule],
                     "tau": tokens[rule] / forwards[rule],
                     "log_likelihood_per_token": likelihood[rule] / tokens[rule]})
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "lossy_curve.json").write_text(json.dumps({"method": method, "prompts": count, "seed": seed,
                                                      "samples_per_prompt": SAMPLES, "max_new_tokens": NEW,
                                                      "temperature": SAMPLING.temperature, "rows": rows},
                                                     indent=2))
    print(f"\n| rule ({method}, temperature {SAMPLING.temperature}) | speedup vs exact (per token) | τ | "
          "mean log-likelihood per token | vs exact |")
    print("| :--- | ---: | ---: | ---: | ---: |")
    base = rows[0]["log_likelihood_per_token"]
    for row in rows:
        print(f"| {row['rule']} | {row['speedup_vs_exact']:.2f}× | {row['tau']:.2f} | "
              f"{row['log_likelihood_per_token']:.3f} | {row['log_likelihood_per_token'] - base:+.3f} |")
    figure, axis = plt.subplots(figsize=(6, 4))
    axis.plot([r["speedup_vs_exact"] for r in rows], [r["log_likelihood_per_token"] for r in rows], "o-")
    for row in rows:
        axis.annotate(row["rule"], (row["speedup_vs_exact"], row["log_likelihood_per_token"]),
                      textcoords="offset points", xytext=(5, 5))
    axis.set_xlabel("speedup per token against exact sampling")
    axis.set_ylabel("target's mean log-likelihood per token")
    axis.set_title(f"Lossy tv:X acceptance, {method}, T = {SAMPLING.temperature} (LOSSY above exact)")
    figure.tight_layout()
    figure.savefig(out / "lossy_curve.png", dpi=120)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out_dir", help="where the table, JSON and plot go")
    parser.add_argument("method", nargs="?", default="eagle")
    parser.add_argument("count", type=int, nargs="?", default=8, help="held-out prompts")
    parser.add_argument("seed", type=int, nargs="?", default=797, help="which held-out prompts")
    args = parser.parse_args()
    main(args.out_dir, args.method, args.count, args.seed)
