"""`verispec.generate` and `verispec.stream`: Hugging Face `generate()`-shaped entry points.

The speculation method follows from the arguments, as in Hugging Face: `assistant_model` ->
independent draft model, `prompt_lookup_num_tokens` -> prompt lookup, `assistant_early_exit` ->
early exit; none of them -> plain decoding. Outputs are the target's own (lossless).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, fields, replace
from typing import Any

import torch
from transformers import PreTrainedModel

from verispec.core.errors import VerispecError
from verispec.core.tree import TreeSettings
from verispec.core.types import SamplingParams
from verispec.methods import HF_SELECTORS, PLAIN
from verispec.model.loading import LoadedModel, load
from verispec.options import DraftOptions
from verispec.request import Prompts, Request, Results, build_request, run
from verispec.request import stream as stream_request

ModelLike = str | LoadedModel | PreTrainedModel


def _as_loaded(model: ModelLike, tokenizer=None) -> LoadedModel:
    if isinstance(model, LoadedModel):
        return model if tokenizer is None else replace(model, tokenizer=tokenizer)
    if isinstance(model, PreTrainedModel):
        return LoadedModel(model.eval(), tokenizer, type(model).__name__)
    if isinstance(model, str):
        loaded = load(model)
        return loaded if tokenizer is None else replace(loaded, tokenizer=tokenizer)
    raise VerispecError(f"model must be a name, a path, a LoadedModel or a PreTrainedModel, "
                        f"got {type(model).__name__}")


@dataclass(frozen=True)
class Speculation:
    """The keywords that choose and tune speculation: Hugging Face generate()'s (one of
    assistant_model, prompt_lookup_num_tokens and assistant_early_exit picks the method, the
    others set its DraftOptions fields) and verispec's own (method=, options=, tree=, acceptance=)."""

    assistant_model: ModelLike | None = None
    assistant_tokenizer: Any = None  # the assistant_model's tokenizer, where it is not the target's
    num_assistant_tokens: int | None = None
    num_assistant_tokens_schedule: str | None = None
    assistant_confidence_threshold: float | None = None
    prompt_lookup_num_tokens: int | None = None
    max_matching_ngram_size: int | None = None
    assistant_early_exit: int | None = None
    tree: TreeSettings | str | None = None
    acceptance: str | None = None
    method: str | None = None
    options: DraftOptions | None = None

    @staticmethod
    def of(keywords: dict[str, Any]) -> Speculation:
        """From generate()'s keywords; one it does not take is a TypeError, as Python's own."""
        known = {f.name for f in fields(Speculation)}
        for name in keywords:
            if name not in known:
                raise TypeError(f"generate() got an unexpected keyword argument {name!r}")
        return Speculation(**keywords)

    def chosen_method(self) -> str:
        """The method chosen (one at most): method=, or the Hugging Face keyword given, else plain."""
        selectors = {"assistant_model": self.assistant_model,
                     "prompt_lookup_num_tokens": self.prompt_lookup_num_tokens,
                     "assistant_early_exit": self.assistant_early_exit}
        chosen = [name for name, value in selectors.items() if value is not None]
        if self.method is not None:
            chosen.append(f"method={self.method!r}")
        if len(chosen) > 1:
            raise VerispecError(f"choose one speculation method, got {' and '.join(chosen)}")
        if self.options is not None and not chosen:
            raise VerispecError("options= sets a method's settings: give method= too")
        if self.method is not None:
            return self.method
        return HF_SELECTORS[chosen[0]] if chosen else PLAIN

    def draft_options(self, target: LoadedModel) -> DraftOptions:
        """options= with the Hugging Face-style keywords for its fields applied: given ones
        apply, and may not contradict each other or a field options= sets."""
        keywords = {"num_assistant_tokens": ("k", self.num_assistant_tokens),
                    "num_assistant_tokens_schedule": ("schedule", self.num_assistant_tokens_schedule),
                    "assistant_confidence_threshold": ("confidence_threshold",
                                                       self.assistant_confidence_threshold),
                    "max_matching_ngram_size": ("max_ngram", self.max_matching_ngram_size),
                    "tree": ("tree", self.tree), "acceptance": ("acceptance", self.acceptance),
                    "prompt_lookup_num_tokens": ("k", self.prompt_lookup_num_tokens),
                    "assistant_early_exit": ("exit_layer", self.assistant_early_exit),
                    "assistant_model": ("draft", self.draft(target))}
        options = self.options or DraftOptions()
        given: dict[str, tuple[str, object]] = {}
        for keyword, (name, value) in keywords.items():
            if value is None:
                continue
            if name in given and given[name][1] != value:
                raise VerispecError(f"{name} given twice: {given[name][0]}={given[name][1]!r} and "
                                    f"{keyword}={value!r}")
            set_by_options = getattr(options, name)
            if set_by_options != getattr(DraftOptions(), name) and set_by_options != value:
                raise VerispecError(f"{name} given twice: options.{name}={set_by_options!r} and "
                                    f"{keyword}={value!r}")
            given[name] = (keyword, value)
        return replace(options, **{name: value for name, (_, value) in given.items()})

    def draft(self, target: LoadedModel) -> str | LoadedModel | None:
        """assistant_model as DraftOptions.draft takes it: with its own tokenizer where given,
        else the target's for a bare PreTrainedModel."""
        if self.assistant_tokenizer is not None and (self.assistant_model is None
                                                     or target.tokenizer is None):
            raise VerispecError("assistant_tokenizer= is the assistant_model's tokenizer, beside the "
                                "target's (tokenizer=): give all three")
        if self.assistant_model is None:
            return None
        if self.assistant_tokenizer is not None:  # its own tokenizer, maybe not the target's
            return _as_loaded(self.assistant_model, self.assistant_tokenizer)
        if isinstance(self.assistant_model, (str, LoadedModel)):
            return self.assistant_model
        return _as_loaded(self.assistant_model, target.tokenizer)


def prepare(
    model: ModelLike,
    inputs: Prompts,
    *,
    max_new_tokens: int = 128,
    do_sample: bool = False,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int | None = None,
    eos_token_id: int | Iterable[int] | None = None,
    stop_strings: str | Iterable[str] | None = None,
    tokenizer=None,
    chat: bool = False,
    num_return_sequences: int = 1,
    prediction: str | list[str] | None = None,
    num_beams: int = 1,
    length_penalty: float = 1.0,
    early_stopping: bool | str = False,
    json_schema: dict | str | list | None = None,
    regex: str | list | None = None,
    grammar: str | list | None = None,
    **speculation: Any,
) -> tuple[LoadedModel, Request]:
    """Translate Hugging Face-style arguments into a Request (validated; see `generate`); the
    keywords that choose and tune speculation are a Speculation's fields."""
    target = _as_loaded(model, tokenizer)
    how = Speculation.of(speculation)
    return target, build_request(
        target, inputs, chat=chat, method=how.chosen_method(), options=how.draft_options(target),
        sampling=SamplingParams.of(temperature, top_k, top_p, do_sample=do_sample),
        max_new_tokens=max_new_tokens, eos_token_id=eos_token_id, stop_strings=stop_strings,
        seed=seed, sequences=num_return_sequences, prediction=prediction, json_schema=json_schema,
        regex=regex, grammar=grammar, num_beams=num_beams, length_penalty=length_penalty,
        early_stopping=early_stopping)


def generate(model: ModelLike, inputs: Prompts, *, streamer=None,
             **kwargs) -> Results:
    """Generate from `model` (a name, path, LoadedModel or PreTrainedModel), losslessly faster.

    inputs: text (tokenized raw, or through the chat template with chat=True) or token ids
    ([n] or [1, n]); or a batch: a list of texts or of id lists (or ids [batch, n]), decoded
    together (one target pass per step for all, each with its own drafts and acceptance) into a
    list of results, each what its prompt would give alone. Keyword arguments follow Hugging
    Face `generate()`: max_new_tokens, do_sample, temperature, top_k, top_p, seed,
    assistant_model, num_assistant_tokens, num_assistant_tokens_schedule ("constant" |
    "heuristic"), assistant_confidence_threshold, prompt_lookup_num_tokens,
    max_matching_ngram_size, assistant_early_exit, eos_token_id, stop_strings, tokenizer,
    assistant_tokenizer (the assistant_model's, where it is not the target's: its drafts are
    carried into the target's tokens, exactly; docs/cross-tokenizer.md), num_return_sequences
    (n sequences per prompt sharing its prefill, a prompt's together in the list; with a seed,
    sequence i is seeded with seed + i). verispec adds method=NAME (any
    registered method, e.g. "self-int4-pld", "eagle"; num_assistant_tokens is then its k;
    instead of the keywords above) with options=DraftOptions(...) for its other settings (e.g.
    lookahead_window), tree=TreeSettings(topk, nodes) or tree="default" (the
    method's measured default tree), prediction=TEXT (OpenAI's predicted outputs: text the
    answer is expected to be mostly, drafted before the method's drafter wherever the output is
    in it; a list of texts for a batch; usage in result.stats.accepted_prediction_tokens /
    rejected_prediction_tokens), json_schema=SCHEMA (a dict or JSON text), regex=PATTERN or
    grammar=LARK (the output matches it: the target's distribution masked to what the grammar
    allows, exactly, with every method; tokens the grammar forces are drafted for free, counted
    in result.stats.forced_tokens; a list gives each prompt of a batch its own, None for none),
    and acceptance="typical" (Medusa's typical acceptance: LOSSY
    under sampling, the output no longer follows the target's distribution; default "exact").
    num_beams=B (> 1: beam search, exactly plain beam search's sequences and scores, with
    speculation: verispec.decoding.beam; methods drafting chains by prompt lookup or a model drafter),
    length_penalty and early_stopping (True, False or "never") as Hugging Face defines them;
    it returns BeamResults (token ids, text, score), num_return_sequences <= B per prompt.
    A Hugging Face-style `streamer` (put/end) receives the prompt, then each committed block of
    tokens (one sequence only).

    Returns a GenerationResult (a list of them for a batch or several sequences): new token
    ids, text, the steps with each token's fate, and stats.
    """
    return run(*prepare(model, inputs, **kwargs), streamer=streamer)


def stream(model: ModelLike, inputs: str | list[int] | torch.Tensor, **kwargs) -> Iterator[str]:
    """Yield the generated text piece by piece as tokens are committed (same arguments)."""
    yield from stream_request(*prepare(model, inputs, **kwargs))
