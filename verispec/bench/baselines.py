"""The baselines the bench runs beside verispec's methods: Hugging Face generate() plain and in
its speculative modes, timed and counted like verispec's runs. A baseline is a function that
builds a Contender plus its entry in BASELINES."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from verispec.bench.contender import BenchConfig, Contender, Outcome, exit_layer
from verispec.bench.llamacpp import LOOKUP_TOKENS, llamacpp_generator
from verispec.core.errors import VerispecError
from verispec.core.types import SamplingParams
from verispec.drafters.model import same_vocabulary
from verispec.model.loading import LoadedModel

PLD_TOKENS = 10  # what hf-pld drafts per step (Hugging Face's prompt_lookup_num_tokens)

# name, target, draft model (None without --draft), config, sampling -> a contender
Build = Callable[[str, LoadedModel, LoadedModel | None, BenchConfig, SamplingParams], Contender]


def fits_always(target: LoadedModel, draft: LoadedModel | None) -> str | None:
    return None


@dataclass(frozen=True)
class Baseline:
    build: Build
    needs_draft: bool = False  # needs --draft: a Hugging Face model, not a verispec student
    # Why it cannot run beam search (--num-beams); None: it can.
    beam_refusal: str | None = "it decodes one path"
    # Why it cannot run this target and draft (None: it can), and the baseline that runs them.
    unfit: Callable[[LoadedModel, LoadedModel | None], str | None] = fits_always
    instead: str | None = None


def shares_tokenizer(target: LoadedModel, draft: LoadedModel | None) -> str | None:
    """Hugging Face's assisted generation takes a draft with the target's tokenizer."""
    if draft is not None and not same_vocabulary(target.tokenizer, draft.tokenizer):
        return "the draft's tokenizer is not the target's (hf-uag runs the pair)"
    return None


def has_another_tokenizer(target: LoadedModel, draft: LoadedModel | None) -> str | None:
    """Hugging Face's universal assisted generation takes a draft with another tokenizer (it
    refuses assistant_tokenizer= where the draft shares the target's)."""
    if draft is not None and same_vocabulary(target.tokenizer, draft.tokenizer):
        return "the draft shares the target's tokenizer (hf-assisted runs the pair)"
    return None


HF_SPECULATIVE = "Hugging Face generate() refuses num_beams > 1 with speculation"


def hf_generate(extra: Callable[[LoadedModel, LoadedModel | None, BenchConfig], dict],
                counts_forwards: bool = True) -> Build:
    """A baseline: Hugging Face generate() with the keywords `extra` gives (its speculative mode),
    HF defaults otherwise, and with --num-beams its beam search (num_beams, length_penalty,
    early_stopping). Target forwards are counted by a hook, unless the drafter is the target
    itself (early exit); its beam search takes one search step per forward."""
    def build(name: str, target: LoadedModel, draft: LoadedModel | None, config: BenchConfig,
              sampling: SamplingParams) -> Contender:
        model = target.model
        eos = sorted(target.eos_token_ids)
        settings = {"max_new_tokens": config.max_new_tokens, "do_sample": not sampling.greedy,
                    "eos_token_id": eos, "pad_token_id": eos[0] if eos else 0,
                    **extra(target, draft, config)}
        if config.beams is not None:
            settings |= {"num_beams": config.beams.num_beams, "length_penalty": config.beams.length_penalty,
                         "early_stopping": config.beams.early_stopping}
        if not sampling.greedy:  # the same warps as verispec's
            settings |= {"temperature": sampling.temperature, "top_k": sampling.top_k,
                         "top_p": sampling.top_p}

        def generate(prompt_ids: list[int]) -> Outcome:
            calls = [0]
            hook = model.register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
            inputs = torch.tensor([prompt_ids], device=model.device)
            torch.manual_seed(config.seed)
            try:
                started = time.perf_counter()
                output = model.generate(inputs, **settings)
                tokens = output[0, len(prompt_ids):].tolist()
                seconds = time.perf_counter() - started
            finally:
                hook.remove()
            forwards = calls[0] if counts_forwards else None
            return Outcome(tokens, seconds, forwards, search_steps=None if config.beams is None else forwards)

        return Contender(name, name, settings.get("prompt_lookup_num_tokens"), generate, baseline=True)

    return build


def llamacpp(lookup: bool) -> Build:
    """A baseline: llama.cpp's greedy decoding of the target's own GGUF file (with lookup,
    llama-cpp-python's Python-level prompt lookup), with as many threads as torch uses."""
    def build(name: str, target: LoadedModel, draft: LoadedModel | None, config: BenchConfig,
              sampling: SamplingParams) -> Contender:
        if target.gguf is None:
            raise VerispecError(f"{name} runs the target's GGUF file: give --model a .gguf file or a "
                                f"built-in name ({target.name} has none)")
        if not sampling.greedy:
            raise VerispecError(f"{name} runs greedy decoding only: use --temperature 0")
        run = llamacpp_generator(target.gguf, lookup, torch.get_num_threads(), config.max_new_tokens,
                                 set(target.eos_token_ids))

        def generate(prompt_ids: list[int]) -> Outcome:
            tokens, seconds = run(prompt_ids)
            return Outcome(tokens, seconds, None)

        return Contender(name, name, LOOKUP_TOKENS if lookup else None, generate, baseline=True,
                         peer=True)

    return build


BASELINES: dict[str, Baseline] = {
    "hf": Baseline(hf_generate(lambda target, draft, config: {}), beam_refusal=None),
    "hf-pld": Baseline(hf_generate(lambda target, draft, config: {"prompt_lookup_num_tokens": PLD_TOKENS}),
                       beam_refusal=HF_SPECULATIVE),
    "hf-assisted": Baseline(hf_generate(lambda target, draft, config: {"assistant_model": draft.model}),
                            needs_draft=True, beam_refusal=HF_SPECULATIVE, unfit=shares_tokenizer,
                            instead="hf-uag"),
    # Universal assisted generation (transformers 5.23: greedy re-encodes the draft's text through
    # both tokenizers, sampling drafts among the tokens both vocabularies share).
    "hf-uag": Baseline(hf_generate(lambda target, draft, config: {
        "assistant_model": draft.model, "tokenizer": target.tokenizer,
        "assistant_tokenizer": draft.tokenizer}), needs_draft=True, beam_refusal=HF_SPECULATIVE,
        unfit=has_another_tokenizer, instead="hf-assisted"),
    "hf-early-exit": Baseline(hf_generate(
        lambda target, draft, config: {"assistant_early_exit": exit_layer(target, config)},
        counts_forwards=False), beam_refusal=HF_SPECULATIVE),
    "llama.cpp": Baseline(llamacpp(lookup=False), beam_refusal="verispec runs llama.cpp greedy only"),
    "llama.cpp-lookup": Baseline(llamacpp(lookup=True), beam_refusal="verispec runs llama.cpp greedy only"),
}

