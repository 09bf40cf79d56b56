"""Scenarios where drafts come from structure and history (docs/scenarios.md), on the built-in
model, greedy, float32, one run each: every figure is a ratio against a baseline from the same run.

repeat: the same questions asked twice; `suffix` on the second pass (its cache holds the first
pass's answers) against its first pass and against `pld`, each beside `ar`.
edit: code edits with the original file as the prediction (generate(prediction=...)), `ar` and
`pld` with and without it.

The questions and files are written for this script (no Spec-Bench questions).
Usage: PYTHONPATH=. python3 scripts/scenarios.py [--new 96] [--out docs/scenarios.md]
"""

from __future__ import annotations

import argparse
import platform
import subprocess
import time
from pathlib import Path

import torch

from verispec.api import encode_prompt
from verispec.drafters.prediction import PredictionDrafter
from verispec.drafters.suffix import forget_outputs
from verispec.methods import build_engine
from verispec.models import load
from verispec.stopping import StoppingRules
from verispec.types import GenerationStats

QUESTIONS = [
    "List the planets of the solar system in order from the Sun, one per line.",
    "Explain in three sentences what a hash table is.",
    "Write a Python function that returns the n-th Fibonacci number.",
    "What are the primary colours? Answer in one short paragraph.",
    "Give three tips for writing clear commit messages.",
    "Describe how a bicycle gear works, briefly.",
]

EDITS = [
    ("Rename the function `add` to `plus` in this file and change nothing else.",
     "def add(a, b):\n    \"\"\"Return the sum of a and b.\"\"\"\n    return a + b\n\n\n"
     "def twice(x):\n    return add(x, x)\n\n\nprint(twice(21))\n"),
    ("Add a docstring to `area` in this file and change nothing else.",
     "import math\n\n\ndef area(radius):\n    return math.pi * radius ** 2\n\n\n"
     "def circumference(radius):\n    \"\"\"The length around a circle.\"\"\"\n"
     "    return 2 * math.pi * radius\n"),
    ("Change the greeting from Hello to Hi in this file and change nothing else.",
     "def greet(name):\n    message = \"Hello, \" + name + \"!\"\n    print(message)\n"
     "    return message\n\n\n"
     "for person in [\"Ada\", \"Alan\", \"Grace\"]:\n    greet(person)\n"),
]


def cpu() -> str:
    for line in subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines():
        if line.startswith("Model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def run(engine, prompts: list[list[int]], stopping: StoppingRules,
        predictions: list[list[int]] | None = None) -> tuple[GenerationStats, float, list]:
    """Generate each prompt alone (with its prediction, if given); (summed stats, seconds,
    outputs)."""
    stats, outputs = [], []
    started = time.perf_counter()
    for prompt, prediction in zip(prompts, predictions or [None] * len(prompts)):
        result = engine.generate(prompt, stopping, prediction=None if prediction is None
                                 else PredictionDrafter(prediction))
        stats.append(result.stats)
        outputs.append(result.token_ids)
    return GenerationStats.total(stats), time.perf_counter() - started, outputs


def row(label: str, stats: GenerationStats, seconds: float, base: float, same: bool) -> str:
    tps = stats.new_tokens / seconds
    return (f"| {label} | {stats.new_tokens} | {stats.mean_accepted_tokens:.2f} | {tps:.1f} | "
            f"{tps / base:.2f}x | {'yes' if same else 'NO'} |")


HEADER = ["| run | new tokens | tau | tokens/s | vs ar | identical to ar |",
          "| :--- | ---: | ---: | ---: | ---: | :--- |"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--new", type=int, default=96)
    parser.add_argument("--scenarios", default="repeat,edit")
    parser.add_argument("--out", type=Path, default=Path("docs/scenarios.md"))
    args = parser.parse_args()
    target = load("smollm2-135m-instruct")
    stopping = StoppingRules.build(args.new, target.eos_token_ids)
    lines = [f"# Scenarios\n\nBuilt-in model (SmolLM2-135M-Instruct), float32, greedy, {args.new} new "
             f"tokens at most, one run on {cpu()} (2 cores shared with other work: timings are "
             f"noisy), torch {torch.__version__}, {time.strftime('%Y-%m-%d')}. Made by "
             f"`scripts/scenarios.py`.\n"]
    if "repeat" in args.scenarios:
        prompts = [encode_prompt(target, q, chat=True) for q in QUESTIONS]
        forget_outputs(target.model)
        ar_stats, ar_seconds, ar_out = run(build_engine(target, "ar"), prompts, stopping)
        base = ar_stats.new_tokens / ar_seconds
        pld_stats, pld_seconds, pld_out = run(build_engine(target, "pld"), prompts, stopping)
        suffix = build_engine(target, "suffix")
        first = run(suffix, prompts, stopping)
        second = run(suffix, prompts, stopping)
        lines += ["## The same questions asked twice\n",
                  f"{len(QUESTIONS)} questions, each answered alone; `suffix` keeps the model's "
                  "earlier outputs in its cache, so its second pass drafts from the first pass's "
                  "answers.\n", *HEADER,
                  row("ar", ar_stats, ar_seconds, base, True),
                  row("pld", pld_stats, pld_seconds, base, pld_out == ar_out),
                  row("suffix, first pass", first[0], first[1], base, first[2] == ar_out),
                  row("suffix, second pass", second[0], second[1], base, second[2] == ar_out), ""]
    if "edit" in args.scenarios:
        prompts = [encode_prompt(target, f"{task}\n\n```python\n{code}```", chat=True)
                   for task, code in EDITS]
        predictions = [target.tokenizer(f"```python\n{code}```")["input_ids"] for _, code in EDITS]
        ar_stats, ar_seconds, ar_out = run(build_engine(target, "ar"), prompts, stopping)
        base = ar_stats.new_tokens / ar_seconds
        lines += ["## Code edits with the original file as the prediction\n",
                  f"{len(EDITS)} small edits; the prediction is the original file in a code fence.\n",
                  HEADER[0] + " prediction tokens accepted / rejected |", HEADER[1] + " ---: |",
                  row("ar", ar_stats, ar_seconds, base, True) + " |"]
        for method in ("ar", "pld"):
            engine = build_engine(target, method)
            if method != "ar":
                stats, seconds, out = run(engine, prompts, stopping)
                lines.append(row(method, stats, seconds, base, out == ar_out) + " |")
            stats, seconds, out = run(engine, prompts, stopping, predictions)
            lines.append(row(f"{method} + prediction", stats, seconds, base, out == ar_out)
                         + f" {stats.accepted_prediction_tokens} / {stats.rejected_prediction_tokens} |")
        lines.append("")
    args.out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
