"""llama.cpp's two Python paths on the built-in GGUF, interleaved question by question: the
high-level `Llama.generate` (a Python sampler per token; the bench's llama.cpp row until issue 49)
and the low-level decode loop (`llama_decode`, llama.cpp's own greedy sampler; the row now).

Prints, per path: tokens per second over the bench's questions (prompt prefill included, as the
bench times it), and decode tokens per second at a depth of 300 cached tokens (the time of 128
new tokens less that of 1, as `llama-bench -p 0 -n 128 -d 300` times tg128 at depth 300), and
how many outputs the two paths agree on. Run on an idle machine, beside llama-bench:

    python scripts/llamacpp_paths.py --threads 2
    llama-bench -m "$(python -c 'from verispec.model.loading import builtin_gguf, DEFAULT_MODEL;
print(builtin_gguf(DEFAULT_MODEL))')" -t 2 -p 0 -n 128 -d 300 -r 5
"""

from __future__ import annotations

import argparse
import statistics

from verispec.bench.llamacpp import llamacpp_decoder, llamacpp_generator
from verispec.bench.questions import load_questions
from verispec.model.loading import DEFAULT_MODEL, builtin_gguf, load_model
from verispec.request import encode_prompt

DEPTH = 300


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--limit-per-task", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=5, help="depth-300 timings per path (median)")
    options = parser.parse_args()
    gguf = builtin_gguf(DEFAULT_MODEL)
    target = load_model(DEFAULT_MODEL)  # its tokenizer and end tokens (the GGUF is what runs)
    eos = set(target.eos_token_ids)
    questions = load_questions(None, None, options.limit_per_task)
    prompts = [encode_prompt(target, q.prompt, chat=True) for q in questions]
    paths = {
        "high-level generate": lambda eos, n: llamacpp_generator(gguf, False, options.threads, n, eos),
        "low-level decode loop": lambda eos, n: llamacpp_decoder(gguf, options.threads, n, eos),
    }
    runs = {name: make(eos, options.max_new_tokens) for name, make in paths.items()}
    for run in runs.values():  # warm-up
        run(prompts[0])
    totals = {name: [0, 0.0] for name in runs}
    outputs: dict[str, list[list[int]]] = {name: [] for name in runs}
    for index, prompt in enumerate(prompts):
        names = list(runs)
        for name in names[index % 2:] + names[:index % 2]:  # the order alternates
            outcome = runs[name](prompt)
            totals[name][0] += len(outcome.tokens)
            totals[name][1] += outcome.seconds
            outputs[name].append(outcome.tokens)
    deep = (prompts[0] * (DEPTH // len(prompts[0]) + 1))[:DEPTH]
    decode: dict[str, list[float]] = {name: [] for name in paths}
    # No end token: 128 new tokens every time.
    long_runs = {name: (make(set(), 128), make(set(), 1)) for name, make in paths.items()}
    for _ in range(options.repeats):
        for name, (long, short) in long_runs.items():
            decode[name].append(127 / (long(deep).seconds - short(deep).seconds))
    agree = sum(a == b for a, b in zip(*outputs.values()))
    print(f"{gguf.name}, {options.threads} threads, {len(prompts)} questions, "
          f"{options.max_new_tokens} new tokens")
    for name in paths:
        tokens, seconds = totals[name]
        print(f"{name:22s} {tokens / seconds:7.1f} tok/s with prefill   "
              f"decode at depth {DEPTH}: {statistics.median(decode[name]):7.1f} tok/s")
    print(f"identical outputs: {agree}/{len(prompts)}")


if __name__ == "__main__":
    main()
