"""What plain decoding (`ar`) adds to its bare forwards: the engine's greedy generation against a
bare loop of one-token forwards over the same positions (the same prompt prefill, then each
answer token fed alone, its logits' argmax taken), alternated, best of 3. With one thread it
times CPU time (steady under a loaded machine); with more, wall time (use an idle machine).

    PYTHONPATH=$PWD python3 scripts/ar_overhead.py int4 bfloat16 float32 [--new 512] [--prompt 50]
        [--threads 1]
"""

from __future__ import annotations

import argparse
import time

import torch

from verispec.core.stopping import StoppingRules
from verispec.decoding.engine import SpeculativeEngine
from verispec.decoding.sequence import SequenceSpec
from verispec.model.cached_model import CachedModel
from verispec.model.loading import DEFAULT_MODEL, load_model


def measure(dtype: str, new: int, prompt_tokens: int, clock) -> tuple[float, float]:
    """Seconds of `ar` and of the bare loop (best of 3 each, alternated)."""
    model = load_model(DEFAULT_MODEL, dtype).model
    engine = SpeculativeEngine(model)
    prompt = list(range(1000, 1000 + prompt_tokens))
    stopping = StoppingRules(max_new_tokens=new, eos_token_ids=set())
    answer = engine.generate(SequenceSpec(prompt, stopping)).token_ids
    bare = CachedModel(model)
    fed = torch.tensor([prompt[-1], *answer[:-1]])

    def loop() -> None:
        bare.reset()
        bare.prefill(torch.tensor(prompt[:-1]))
        for i in range(len(fed)):
            int(bare.forward_last(fed[i: i + 1]).argmax())

    ar, plain = [], []
    for _ in range(3):
        started = clock()
        engine.generate(SequenceSpec(prompt, stopping))
        ar.append(clock() - started)
        started = clock()
        loop()
        plain.append(clock() - started)
    return min(ar), min(plain)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("dtypes", nargs="+", choices=("float32", "bfloat16", "int4"))
    parser.add_argument("--new", type=int, default=512, help="new tokens (a long answer)")
    parser.add_argument("--prompt", type=int, default=50, help="prompt tokens")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    clock = time.thread_time if args.threads == 1 else time.perf_counter
    for dtype in args.dtypes:
        ar, plain = measure(dtype, args.new, args.prompt, clock)
        print(f"{dtype}: ar {ar * 1e3:.0f} ms, bare forwards {plain * 1e3:.0f} ms over the same "
              f"{args.new} positions: {(ar - plain) / args.new * 1e3:.3f} ms a token "
              f"({100 * (ar / plain - 1):.1f}%)")


if __name__ == "__main__":
    main()
