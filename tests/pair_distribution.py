"""The engine's first two sampled tokens against the target's exact joint distribution.

For a drafter (or a mask) under test: `empirical_pairs` samples many sequences of one prompt as one
batch (they share the prefill) and counts their first two tokens; `exact_pairs` computes
p(t1) * p(t2 | t1) from the target directly, after the same warps (and the same mask, where a
`mask` function is given). The TV distance between them is checked against tv_bound.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from verispec.core.sampling import warp_probs
from verispec.core.stopping import StoppingRules
from verispec.core.types import GenerationResult, SamplingParams
from verispec.decoding.engine import SpeculativeEngine

# mask(prefix of new tokens) -> [vocab] bool of the tokens allowed next (None: all)
MaskFn = Callable[[list[int]], torch.Tensor | None]


def masked_probs(logits: torch.Tensor, sampling: SamplingParams,
                 allowed: torch.Tensor | None) -> torch.Tensor:
    """The target's warped distribution [vocab], restricted to `allowed` and renormalized."""
    if allowed is not None:
        logits = logits.masked_fill(~allowed, float("-inf"))
    return warp_probs(logits, sampling)


@torch.no_grad()
def exact_pairs(model: torch.nn.Module, prompt: list[int], sampling: SamplingParams,
                mask: MaskFn = lambda prefix: None) -> torch.Tensor:
    """p(t1, t2) [vocab, vocab] in float64."""
    logits = model(torch.tensor([prompt])).logits[0, -1]
    first = masked_probs(logits, sampling, mask([])).double()
    vocab = first.shape[0]
    joint = torch.zeros(vocab, vocab, dtype=torch.float64)
    for t1 in first.nonzero().flatten().tolist():
        logits = model(torch.tensor([prompt + [t1]])).logits[0, -1]
        joint[t1] = first[t1] * masked_probs(logits, sampling, mask([t1])).double()
    return joint


def empirical_pairs(engine: SpeculativeEngine, prompt: list[int], sampling: SamplingParams,
                    samples: int, seed: int, **extra) -> tuple[torch.Tensor, list[GenerationResult]]:
    """Frequencies of the first two tokens [vocab, vocab] over `samples` sequences of 3 tokens,
    generated one at a time (a large batch would be capped to short drafts by the engine's load
    cap); `extra`: more arguments for engine.generate."""
    vocab = engine.vocab_size
    counts = torch.zeros(vocab, vocab, dtype=torch.float64)
    results = [engine.generate(prompt, StoppingRules.build(3), sampling, seed + i, **extra)
               for i in range(samples)]
    for result in results:
        counts[result.token_ids[0], result.token_ids[1]] += 1
    return counts / samples, results
