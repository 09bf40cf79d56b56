"""Scenarios where drafts come from structure and history (docs/scenarios.md), on the built-in
model, greedy, float32, one run each: every figure is a ratio against a baseline from the same run.

repeat: the same questions asked twice; `suffix` on the second pass (its cache holds the first
pass's answers) against its first pass and against `pld`, each beside `ar`.
edit: code edits with the original file as the prediction (generate(prediction=...)), `ar` and
`pld` with and without it.
json: facts extracted from short texts as JSON matching a schema (constrained decoding), plain
decoding and speculation under the same grammar, with the outputs validated.

The questions and files are written for this script (no Spec-Bench questions).
Usage: PYTHONPATH=. python3 scripts/scenarios.py [--new 96] [--out docs/scenarios.md]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import time
from pathlib import Path

import torch

from verispec.core.grammar import Constraint, Grammar
from verispec.core.stopping import StoppingRules
from verispec.core.types import GenerationStats
from verispec.decoding.sequence import SequenceSpec
from verispec.drafters.suffix import forget_outputs
from verispec.methods import build_engine
from verispec.model.loading import load
from verispec.request import encode_prompt

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


PERSON = {"type": "object", "additionalProperties": False,
          "required": ["name", "age", "city", "occupation"],
          "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                         "city": {"type": "string"}, "occupation": {"type": "string"}}}
PEOPLE = [
    "Maria Lopez is a 34-year-old architect who lives in Valencia.",
    "Born 58 years ago, Tom Becker now teaches chemistry in Leipzig.",
    "The baker on our street, Aiko Tanaka (41), moved to Osaka last spring.",
    "Samuel Okafor, a nurse aged 29, rents a flat in Lagos.",
    "In Porto lives Ines Costa, 63, a retired judge.",
    "Liam Walsh is 22 and works as a bicycle mechanic in Galway.",
]


def valid_person(text: str) -> bool:
    """The text is JSON with exactly the schema's keys and types."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return False
    return (isinstance(value, dict) and set(value) == set(PERSON["properties"])
            and isinstance(value["age"], int) and all(isinstance(value[k], str)
                                                      for k in ("name", "city", "occupation")))


def cpu() -> str:
    for line in subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines():
        if line.startswith("Model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def run(engine, prompts: list[list[int]], stopping: StoppingRules,
        predictions: list[list[int]] | None = None,
        constraint: Constraint | None = None) -> tuple[GenerationStats, float, list]:
    """Generate each prompt alone (with its prediction, or a copy of the constraint, if given);
    (summed stats, seconds, outputs)."""
    stats, outputs = [], []
    started = time.perf_counter()
    for prompt, prediction in zip(prompts, predictions or [None] * len(prompts)):
        result = engine.generate(
            SequenceSpec(prompt, stopping, prediction=prediction,
                         constraint=None if constraint is None else constraint.copy()))
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
    parser.add_argument("--scenarios", default="repeat,edit,json")
    parser.add_argument("--out", type=Path, default=Path("docs/scenarios.md"))
    args = parser.parse_args()
    target = load("smollm2-135m-instruct")
    stopping = StoppingRules.build(args.new, target.eos_token_ids)
    load_average = os.getloadavg()[0]
    lines = [f"# Scenarios\n\nBuilt-in model (SmolLM2-135M-Instruct), float32, greedy, {args.new} new "
             f"tokens at most, one run on {cpu()} ({os.cpu_count()} cores, load average {load_average:.1f} "
             f"at the start), torch {torch.__version__}, {time.strftime('%Y-%m-%d')}. Made by "
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
    if "json" in args.scenarios:
        prompts = [encode_prompt(target, f"Extract the person's name, age, city and occupation as "
                                 f"JSON: {text}", chat=True) for text in PEOPLE]
        constraint = Constraint.compile(Grammar.of(json_schema=PERSON), target.tokenizer,
                                        target.vocab_size, target.eos_token_ids)
        ar_stats, ar_seconds, ar_out = run(build_engine(target, "ar"), prompts, stopping,
                                           constraint=constraint)
        base = ar_stats.new_tokens / ar_seconds
        valid = sum(valid_person(target.tokenizer.decode(out, skip_special_tokens=True)) for out in ar_out)
        lines += ["## JSON extraction against a schema\n",
                  f"{len(PEOPLE)} short texts, the answer constrained to a JSON schema of four keys "
                  "(name, age, city, occupation); every row runs under the same grammar, `ar` is "
                  "constrained plain decoding. Forced tokens: the schema's keys and punctuation, "
                  "drafted for free.\n",
                  HEADER[0] + " valid JSON | forced tokens |", HEADER[1] + " ---: | ---: |",
                  row("ar (constrained)", ar_stats, ar_seconds, base, True)
                  + f" {valid}/{len(PEOPLE)} | {ar_stats.forced_tokens} |"]
        free_stats, free_seconds, free_out = run(build_engine(target, "ar"), prompts, stopping)
        valid = sum(valid_person(target.tokenizer.decode(o, skip_special_tokens=True)) for o in free_out)
        lines.append(row("ar, unconstrained (reference)", free_stats, free_seconds, base, free_out == ar_out)
                     + f" {valid}/{len(PEOPLE)} | 0 |")
        for method in ("pld", "suffix", "eagle", "self-int4-pld"):
            forget_outputs(target.model)
            stats, seconds, out = run(build_engine(target, method), prompts, stopping, constraint=constraint)
            valid = sum(valid_person(target.tokenizer.decode(o, skip_special_tokens=True)) for o in out)
            lines.append(row(f"{method} (constrained)", stats, seconds, base, out == ar_out)
                         + f" {valid}/{len(PEOPLE)} | {stats.forced_tokens} |")
        lines.append("")
    args.out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
