"""Hugging Face generate() on a batch of prompts: the reference the batched bench measures
against, and how training data is answered off verispec's lean path."""

from __future__ import annotations

import torch

from verispec.core.types import SamplingParams
from verispec.model.loading import LoadedModel


def hf_generate_batch(target: LoadedModel, prompts: list[list[int]], max_new_tokens: int,
                      sampling: SamplingParams = SamplingParams(), seed: int = 0) -> list[list[int]]:
    """Each prompt's new tokens through its first EOS, from one generate() call on the prompts
    left-padded (every answer starts at the same column) with an attention mask: greedy, or
    sampled with `sampling`'s warps after seeding torch's generator (Hugging Face samples from it)
    with `seed`."""
    model = target.model
    eos = sorted(target.eos_token_ids)
    pad = getattr(target.tokenizer, "pad_token_id", None)
    pad = (eos[0] if eos else 0) if pad is None else pad
    width = max(map(len, prompts))
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=model.device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=model.device)
    warps: dict[str, float] = {}
    if not sampling.greedy:
        warps = {"temperature": sampling.temperature, "top_k": sampling.top_k, "top_p": sampling.top_p}
        torch.manual_seed(seed)
    output = model.generate(ids, attention_mask=mask, max_new_tokens=max_new_tokens,
                            do_sample=not sampling.greedy, eos_token_id=eos, pad_token_id=pad, **warps)
    rows = []
    for row in output[:, width:].tolist():
        end = next((i + 1 for i, t in enumerate(row) if t in target.eos_token_ids), len(row))
        rows.append(row[:end])
    return rows
