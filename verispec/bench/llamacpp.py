"""llama.cpp beside verispec: its plain decoding and its prompt lookup of the same GGUF file,
through `llama-cpp-python` (the optional extra `verispec[llamacpp]`, built from source).

llama.cpp's arithmetic is its own (its Q4 kernels, its reductions): its tokens are compared with
verispec's 4-bit `ar` and the agreement reported, never required.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path

from verispec.bench.contender import Outcome
from verispec.core.errors import VerispecError

INSTALL_HINT = ("llama.cpp baselines need the optional extra, built for this CPU: make llamacpp "
                "(python -m verispec.bench.llamacpp_build: llama-cpp-python builds llama.cpp from "
                "source, about 5 minutes on 2 cores)")
LOOKUP_TOKENS = 10  # llama.cpp's prompt lookup drafts this many tokens (as hf-pld does)


def llamacpp_generator(gguf: Path, lookup: bool, threads: int, max_new_tokens: int,
                       eos: set[int], context: int = 4096) -> Callable[[list[int]], Outcome]:
    """prompt ids -> Outcome (new token ids, seconds including the prompt's prefill), greedy, through
    llama.cpp on `gguf` with `threads` threads; with lookup, llama-cpp-python's prompt lookup
    (LlamaPromptLookupDecoding: an n-gram search in Python, logits kept for every position), not
    llama.cpp's own lookup."""
    try:
        from llama_cpp import Llama
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding
    except ImportError:
        raise VerispecError(INSTALL_HINT) from None
    draft = LlamaPromptLookupDecoding(num_pred_tokens=LOOKUP_TOKENS) if lookup else None
    # Drafted tokens are checked against every position's logits: llama.cpp must keep them all.
    llm = Llama(model_path=str(gguf), n_threads=threads, n_threads_batch=threads, n_ctx=context,
                draft_model=draft, logits_all=lookup, verbose=False)

    def generate(prompt_ids: list[int]) -> Outcome:
        llm.reset()  # no reuse of the previous prompt's cache: every run prefills, as verispec's do
        started = time.perf_counter()
        tokens: list[int] = []
        for token in llm.generate(prompt_ids, top_k=1, temp=0.0, reset=True):
            if token in eos:  # the target's end tokens, where ar stops
                break
            tokens.append(token)
            if len(tokens) >= max_new_tokens:
                break
        return Outcome(tokens, time.perf_counter() - started, None)

    return generate


def llamacpp_decoder(gguf: Path, threads: int, max_new_tokens: int, eos: set[int], context: int = 4096
                     ) -> Callable[[list[int]], Outcome]:
    """prompt ids -> Outcome (new token ids, seconds including the prompt's prefill), greedy, as
    llama.cpp's own programs decode: llama_decode on the whole prompt in one batch, then one token
    a step, each chosen by llama.cpp's greedy sampler (`llama_sampler_init_greedy`), with
    llama.cpp's default context settings (flash attention on auto, as `llama-bench`), on `threads`
    threads. Through llama-cpp-python's low-level API: no Python sampler, no logits copied out.
    The model and context live as long as the process (the bench's child process for the peer)."""
    try:
        import llama_cpp as cpp
    except ImportError:
        raise VerispecError(INSTALL_HINT) from None
    # llama-cpp-python routes llama.cpp's log to this logger: errors only, as Llama(verbose=False).
    logging.getLogger("llama-cpp-python").setLevel(logging.ERROR)
    cpp.llama_backend_init()
    model = cpp.llama_model_load_from_file(str(gguf).encode(), cpp.llama_model_default_params())
    if not model:
        raise VerispecError(f"llama.cpp could not load {gguf}")
    settings = cpp.llama_context_default_params()
    settings.n_ctx = settings.n_batch = context  # any prompt that fits is one batch
    settings.n_threads = settings.n_threads_batch = threads
    llama = cpp.llama_init_from_model(model, settings)
    if not llama:
        raise VerispecError(f"llama.cpp could not make a context of {context} tokens for {gguf}")
    memory = cpp.llama_get_memory(llama)
    sampler = cpp.llama_sampler_chain_init(cpp.llama_sampler_chain_default_params())
    cpp.llama_sampler_chain_add(sampler, cpp.llama_sampler_init_greedy())

    def generate(prompt_ids: list[int]) -> Outcome:
        cpp.llama_memory_clear(memory, True)  # every run prefills, as verispec's do
        cpp.llama_sampler_reset(sampler)
        started = time.perf_counter()
        step = (cpp.llama_token * len(prompt_ids))(*prompt_ids)  # the prompt, then each new token
        tokens: list[int] = []
        while len(tokens) < max_new_tokens:
            if cpp.llama_decode(llama, cpp.llama_batch_get_one(step, len(step))) != 0:
                raise VerispecError(f"llama_decode failed after {len(tokens)} new tokens")
            token = cpp.llama_sampler_sample(sampler, llama, -1)  # the last position's argmax
            if token in eos:
                break
            tokens.append(token)
            step = (cpp.llama_token * 1)(token)
        return Outcome(tokens, time.perf_counter() - started, None)

    return generate
