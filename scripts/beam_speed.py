"""Speculative beam search against plain beam search (verispec's and Hugging Face's), interleaved
question by question: seconds, tokens/s of the best sequence, target passes per search step, and
whether each method's best sequence equals Hugging Face's.

Run: PYTHONPATH=$PWD python3 scripts/beam_speed.py QUESTIONS.jsonl [per_task] [max_new_tokens] [beams]
(e.g. ../shared/specbench/questions.dev.jsonl 2 64 4). Questions are for evaluation only.
"""

from __future__ import annotations

import sys
import time
from collections import Counter
from pathlib import Path

import torch
from transformers import GenerationConfig

import verispec
from verispec.api import encode_prompt
from verispec.bench.questions import load_questions
from verispec.models import DEFAULT_MODEL, load

METHODS = ("ar", "pld", "self-int4")


def trailing(tokens: list[int], pad: int) -> int:
    """How many pad tokens end `tokens`."""
    count = 0
    while count < len(tokens) and tokens[-1 - count] == pad:
        count += 1
    return count


def main(path: str, per_task: int = 2, max_new_tokens: int = 64, beams: int = 4) -> None:
    target = load(DEFAULT_MODEL)
    questions = load_questions(Path(path), None, per_task)
    config = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, num_beams=beams,
                              eos_token_id=sorted(target.eos_token_ids),
                              pad_token_id=target.tokenizer.pad_token_id)
    seconds, tokens, same, passes, steps = Counter(), Counter(), Counter(), Counter(), Counter()
    names = ["hf", *METHODS]
    for index, question in enumerate(questions):
        ids = encode_prompt(target, question.prompt, chat=True)
        outputs = {}
        for name in names[index % len(names):] + names[: index % len(names)]:
            started = time.perf_counter()
            if name == "hf":
                out = target.model.generate(torch.tensor([ids]), generation_config=config)
                outputs[name] = out[0, len(ids):].tolist()
            else:
                result = verispec.generate(target, ids, method=name, num_beams=beams,
                                           max_new_tokens=max_new_tokens)
                outputs[name] = result.token_ids
                passes[name] += result.stats.target_forwards
                steps[name] += result.stats.steps
            seconds[name] += time.perf_counter() - started
        reference, pad = outputs["hf"], target.tokenizer.pad_token_id
        for name in names:  # Hugging Face pads a sequence that ended early; verispec does not
            mine = outputs[name] if name != "hf" else reference[: len(reference) - trailing(reference, pad)]
            tokens[name] += len(mine)
            same[name] += mine == reference[: len(mine)] and all(t == pad for t in reference[len(mine):])
        print(f"question {index + 1}/{len(questions)} done", flush=True)
    print(f"\n| method (B = {beams}) | seconds | vs hf | vs verispec plain | tokens/s | "
          f"search steps per target pass | best sequence = hf's |")
    print("| :--- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name in names:
        per_pass = f"{steps[name] / passes[name]:.2f}" if passes[name] else "1.00"
        print(f"| {name} | {seconds[name]:.1f} | {seconds['hf'] / seconds[name]:.2f}× | "
              f"{seconds['ar'] / seconds[name]:.2f}× | {tokens[name] / seconds[name]:.1f} | {per_pass} | "
              f"{same[name]}/{len(questions)} |")


if __name__ == "__main__":
    if len(sys.argv) < 2:
        raise SystemExit(__doc__)
    main(sys.argv[1], *(int(a) for a in sys.argv[2:]))
