"""llama.cpp beside verispec: its plain decoding and its prompt lookup of the same GGUF file,
through `llama-cpp-python` (the optional extra `verispec[llamacpp]`, built from source).

llama.cpp's arithmetic is its own (its Q4 kernels, its reductions): its tokens are compared with
verispec's 4-bit `ar` and the agreement reported, never required.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from verispec.bench.contender import Outcome
from verispec.core.errors import VerispecError

INSTALL_HINT = ("llama.cpp baselines need the optional extra: pip install 'verispec[llamacpp]' "
                "(llama-cpp-python builds llama.cpp from source: about 5 minutes on 2 cores)")
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
    stop = eos | {llm.token_eos()}

    def generate(prompt_ids: list[int]) -> Outcome:
        llm.reset()  # no reuse of the previous prompt's cache: every run prefills, as verispec's do
        started = time.perf_counter()
        tokens: list[int] = []
        for token in llm.generate(prompt_ids, top_k=1, temp=0.0, reset=True):
            if token in stop:
                break
            tokens.append(token)
            if len(tokens) >= max_new_tokens:
                break
        return Outcome(tokens, time.perf_counter() - started, None)

    return generate
