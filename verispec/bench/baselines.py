"""The baselines the bench runs beside verispec's methods: Hugging Face generate() plain and in
its speculative modes, and llama.cpp, timed and counted like verispec's runs, each in a child
process of its own (verispec.bench.peer_process). A baseline is its entry in BASELINES: a
function that checks it can run and says what its child runs, and how it fits the bench."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from verispec.bench.contender import BenchConfig, Contender, Outcome, exit_layer
from verispec.bench.llamacpp import LOOKUP_TOKENS, llamacpp_decoder, llamacpp_generator
from verispec.bench.peer_process import Job, PeerProcess
from verispec.core.errors import VerispecError
from verispec.core.types import SamplingParams
from verispec.drafters.model import same_vocabulary
from verispec.model.loading import LoadedModel, load_model

PLD_TOKENS = 10  # what hf-pld drafts per step (Hugging Face's prompt_lookup_num_tokens)

# name, target, draft model (None without --draft), config, sampling -> what the baseline's child
# process runs (checked here, in the bench's process, before anything is timed)
Prepare = Callable[[str, LoadedModel, LoadedModel | None, BenchConfig, SamplingParams], Job]


def fits_always(target: LoadedModel, draft: LoadedModel | None) -> str | None:
    return None


@dataclass(frozen=True)
class Baseline:
    prepare: Prepare
    k: int | None = None  # tokens it drafts per step, where it has a fixed number
    needs_draft: bool = False  # needs --draft: a Hugging Face model, not a verispec student
    # Why it cannot run beam search (--num-beams); None: it can.
    beam_refusal: str | None = "it decodes one path"
    # Why it cannot run this target and draft (None: it can), and the baseline that runs them.
    unfit: Callable[[LoadedModel, LoadedModel | None], str | None] = fits_always
    instead: str | None = None
    own_arithmetic: bool = False  # another engine (llama.cpp): agreement with ar, not identity

    def start(self, name: str, job: Job) -> Contender:
        """The baseline's prepared job as a contender that runs in a child process of its own,
        with as many threads as torch uses here: if it crashes, its row is lost and no other."""
        peer = PeerProcess(name, job, torch.get_num_threads())
        return Contender(name, name, self.k, peer.generate, baseline=True, peer=self.own_arithmetic,
                         close=peer.close)


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


@dataclass(frozen=True)
class HFMode:
    """One of Hugging Face generate()'s modes: the keywords that select it (target, draft,
    config -> keywords); target forwards are counted by a hook unless the drafter is the target
    itself (early exit)."""

    keywords: Callable[[LoadedModel, LoadedModel | None, BenchConfig], dict]
    counts_forwards: bool = True


HF_MODES: dict[str, HFMode] = {
    "hf": HFMode(lambda target, draft, config: {}),
    "hf-pld": HFMode(lambda target, draft, config: {"prompt_lookup_num_tokens": PLD_TOKENS}),
    "hf-assisted": HFMode(lambda target, draft, config: {"assistant_model": draft.model}),
    # Universal assisted generation (transformers 5.23: greedy re-encodes the draft's text through
    # both tokenizers, sampling drafts among the tokens both vocabularies share).
    "hf-uag": HFMode(lambda target, draft, config: {
        "assistant_model": draft.model, "tokenizer": target.tokenizer,
        "assistant_tokenizer": draft.tokenizer}),
    "hf-early-exit": HFMode(lambda target, draft, config: {
        "assistant_early_exit": exit_layer(target, config)}, counts_forwards=False),
}


def start_hf(name: str, config: BenchConfig, sampling: SamplingParams, with_draft: bool
             ) -> Callable[[list[int]], Outcome]:
    """In the baseline's child process: load the target (and --draft) as the bench does, and run
    Hugging Face generate() in mode `name`, HF defaults otherwise, and with --num-beams its beam
    search (num_beams, length_penalty, early_stopping); its beam search takes one search step per
    forward."""
    target = load_model(config.model, config.dtype, config.device)
    draft = load_model(config.draft, config.dtype, config.device) if with_draft else None
    mode = HF_MODES[name]
    model = target.model
    eos = sorted(target.eos_token_ids)
    settings = {"max_new_tokens": config.max_new_tokens, "do_sample": not sampling.greedy,
                "eos_token_id": eos, "pad_token_id": eos[0] if eos else 0,
                **mode.keywords(target, draft, config)}
    if config.beams is not None:
        settings |= {"num_beams": config.beams.num_beams, "length_penalty": config.beams.length_penalty,
                     "early_stopping": config.beams.early_stopping}
    if not sampling.greedy:  # the same warps as verispec's
        settings |= {"temperature": sampling.temperature, "top_k": sampling.top_k,
                     "top_p": sampling.top_p}
    # Hugging Face's early-exit mode warns about its own internal arguments on every call.
    import transformers  # seconds to import: not for `verispec bench --help`

    transformers.utils.logging.set_verbosity_error()

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
        forwards = calls[0] if mode.counts_forwards else None
        return Outcome(tokens, seconds, forwards, search_steps=None if config.beams is None else forwards)

    return generate


def hf_job(name: str, target: LoadedModel, draft: LoadedModel | None, config: BenchConfig,
           sampling: SamplingParams) -> Job:
    return Job(start_hf, {"name": name, "config": config, "sampling": sampling,
                          "with_draft": BASELINES[name].needs_draft})


def llamacpp(lookup: bool) -> Prepare:
    """A baseline: llama.cpp's greedy decoding of the target's own GGUF file, as llama.cpp's own
    programs decode (its greedy sampler); with lookup, llama-cpp-python's Python-level prompt
    lookup."""
    def prepare(name: str, target: LoadedModel, draft: LoadedModel | None, config: BenchConfig,
                sampling: SamplingParams) -> Job:
        if target.gguf is None:
            raise VerispecError(f"{name} runs the target's GGUF file: give --model a .gguf file or a "
                                f"built-in name ({target.name} has none)")
        if not sampling.greedy:
            raise VerispecError(f"{name} runs greedy decoding only: use --temperature 0")
        arguments = {"gguf": target.gguf, "threads": torch.get_num_threads(),
                     "max_new_tokens": config.max_new_tokens, "eos": set(target.eos_token_ids)}
        if lookup:
            return Job(llamacpp_generator, arguments | {"lookup": True})
        return Job(llamacpp_decoder, arguments)

    return prepare


BASELINES: dict[str, Baseline] = {
    "hf": Baseline(hf_job, beam_refusal=None),
    "hf-pld": Baseline(hf_job, k=PLD_TOKENS, beam_refusal=HF_SPECULATIVE),
    "hf-assisted": Baseline(hf_job, needs_draft=True, beam_refusal=HF_SPECULATIVE, unfit=shares_tokenizer,
                            instead="hf-uag"),
    "hf-uag": Baseline(hf_job, needs_draft=True, beam_refusal=HF_SPECULATIVE, unfit=has_another_tokenizer,
                       instead="hf-assisted"),
    "hf-early-exit": Baseline(hf_job, beam_refusal=HF_SPECULATIVE),
    "llama.cpp": Baseline(llamacpp(lookup=False), beam_refusal="verispec runs llama.cpp greedy only",
                          own_arithmetic=True),
    "llama.cpp-lookup": Baseline(llamacpp(lookup=True), k=LOOKUP_TOKENS,
                                 beam_refusal="verispec runs llama.cpp greedy only", own_arithmetic=True),
}
