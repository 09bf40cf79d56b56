"""One request, whatever door it comes in by.

The Hugging Face keywords (verispec.api), the command line (verispec.cli.generate, demo), an
OpenAI body (verispec.server.requests) and the bench each translate what they were given into a
`Request` with `build_request`, which validates everything once, before any work, and names the
field at fault (VerispecError.field). `run` and `stream` execute one; the server's scheduler
feeds `Request.specs()` to its running batch. The engine takes the specs as checked here: it
checks none of this again.

    user input --(translator: api / cli / server / bench)--> build_request --> Request
    Request --> run / stream (an engine built for its method) or the server's batch
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from verispec.core.errors import VerispecError
from verispec.core.grammar import Constraint, Grammar
from verispec.core.stopping import StoppingRules
from verispec.core.types import GenerationResult, SamplingParams, Step
from verispec.decoding.beam import BeamDecoder, BeamResult, BeamSettings, check_drafter
from verispec.decoding.engine import SpeculativeEngine
from verispec.decoding.sequence import SequenceSpec, sequence_seed
from verispec.display import TokenPieces
from verispec.methods import PLAIN, engine_for_checked, resolve
from verispec.model.loading import LoadedModel, check_prompt
from verispec.options import DraftOptions

Prompts = str | list[int] | list[str] | list[list[int]] | torch.Tensor
Results = GenerationResult | list[GenerationResult] | BeamResult | list[BeamResult]


@dataclass(frozen=True)
class Request:
    """A validated generation request: one prompt or a batch, how to sample and stop, the method
    and its drafting options, and what the caller adds per prompt."""

    prompts: list[list[int]]  # token ids, one list per prompt
    batched: bool  # the prompts came as a batch: the result is a list
    sampling: SamplingParams
    stopping: StoppingRules
    method: str
    options: DraftOptions  # checked, the tree resolved (TreeSettings or None)
    seed: int | None = None  # each sequence's seed: engine.sequence_seed
    # Sequences per prompt (Hugging Face's num_return_sequences, OpenAI's n); with beams: the
    # best ones returned of one search.
    sequences: int = 1
    predictions: list[list[int] | None] | None = None  # per prompt: its predicted output's ids
    grammars: list[Constraint | None] | None = None  # per prompt: the grammar its output matches
    logprobs: int | None = None  # None: no logprobs; else top alternatives reported per token
    beams: BeamSettings | None = None  # beam search (num_beams > 1) instead of one path

    def specs(self) -> list[SequenceSpec]:
        """What the engine decodes for each prompt (each with a fresh grammar state), each to run
        `sequences` times (engine.add)."""
        predictions = self.predictions or [None] * len(self.prompts)
        grammars = self.grammars or [None] * len(self.prompts)
        return [SequenceSpec(prompt, self.stopping, self.sampling,
                             sequence_seed(self.seed, i, self.sequences), prediction,
                             None if grammar is None else grammar.copy(), self.logprobs)
                for i, (prompt, prediction, grammar) in enumerate(zip(self.prompts, predictions, grammars))]


@contextmanager
def about(field: str):
    """Name `field` in the VerispecErrors raised inside (those naming none yet)."""
    try:
        yield
    except VerispecError as error:
        if error.field is None:
            error.field = field
        raise


def build_request(target: LoadedModel, prompts: Prompts, *, chat: bool | None = False,
                  method: str = PLAIN, options: DraftOptions = DraftOptions(),
                  sampling: SamplingParams = SamplingParams(), max_new_tokens: int = 128,
                  eos_token_id: int | Iterable[int] | None = None,
                  stop_strings: str | Iterable[str] | None = None, seed: int | None = None,
                  sequences: int = 1, prediction: str | list[str | None] | None = None,
                  json_schema: dict | str | list | None = None, regex: str | list | None = None,
                  grammar: str | list | None = None, logprobs: int | None = None,
                  num_beams: int = 1, length_penalty: float = 1.0,
                  early_stopping: bool | str = False,
                  methods: Sequence[str] | None = None) -> Request:
    """Validate a request (raises before any work starts, naming the field at fault).

    prompts: text (through the chat template if chat; None: where the model has one), token ids,
    or a batch of either. sequences: per prompt (sampled, or with beams the best returned).
    prediction, json_schema, regex, grammar: one for every prompt, or a list with one per prompt
    of a batch (None: none). methods: the methods allowed (a server's). Whether the method's
    drafter can draft for beam search is checked by `run`, on the engine it runs (building a
    drafter is work: it is built once)."""
    with about("method"):
        if methods is not None and method not in methods:
            raise VerispecError(f"method {method!r} is not served here; choose from {', '.join(methods)}")
        options = resolve(method, options)
    with about("sequences"):
        if isinstance(sequences, bool) or not isinstance(sequences, int) or sequences < 1:
            raise VerispecError(f"the number of sequences (num_return_sequences, n) must be a positive "
                                f"integer, got {sequences!r}")
    beams = None
    if num_beams != 1:
        with about("num_beams"):
            beams = BeamSettings(num_beams, length_penalty, early_stopping, sequences)
            refused = [name for name, given in (
                ("sampling (do_sample / temperature)", sampling.do_sample),
                ("prediction", prediction is not None), ("logprobs", logprobs is not None),
                ("grammar (json_schema, regex, grammar)",
                 any(value is not None for value in (json_schema, regex, grammar)))) if given]
            if refused:
                raise VerispecError(f"beam search takes no {' and no '.join(refused)}: it is deterministic, "
                                    f"plain beam search's beams over the method's drafts (num_beams > 1)")
    eos = target.eos_token_ids if eos_token_id is None else eos_token_id
    stopping = StoppingRules.build(max_new_tokens, eos, stop_strings, target.tokenizer)
    with about("prompt"):
        ids, batched = encode_prompts(target, prompts, chat)
        if not ids:
            raise VerispecError("the batch of prompts is empty")
        for prompt_ids in ids:
            check_prompt(target.model, prompt_ids, max_new_tokens)
    with about("logprobs"):
        if logprobs is not None and (isinstance(logprobs, bool) or not isinstance(logprobs, int)
                                     or not 0 <= logprobs <= target.vocab_size):
            raise VerispecError(f"logprobs must be in 0..{target.vocab_size}, got {logprobs!r}")
    with about("prediction"):
        predictions = encode_predictions(target, prediction, len(ids), batched)
    with about("grammar"):
        grammars = compile_grammars(target, json_schema, regex, grammar, len(ids), batched)
    return Request(ids, batched, sampling, stopping, method, options, seed, sequences, predictions,
                   grammars, logprobs, beams)


def encode_prompt(target: LoadedModel, inputs: str | list[int] | torch.Tensor,
                  chat: bool | None = False) -> list[int]:
    """Token ids for a prompt: ids pass through; text is tokenized, through the chat template if
    chat (None: where the model has one, else raw)."""
    if isinstance(inputs, torch.Tensor):
        if inputs.dim() == 2 and inputs.shape[0] != 1:
            raise VerispecError(f"one prompt expected, got input_ids of shape {tuple(inputs.shape)}")
        return inputs.reshape(-1).tolist()
    if isinstance(inputs, str):
        if not inputs.strip():
            raise VerispecError("the prompt is empty")
        check_text(inputs, "the prompt")
        if target.tokenizer is None:
            raise VerispecError(f"{target.name} has no tokenizer: pass token ids instead of text")
        if chat is None:
            chat = target.has_chat_template
        if chat:
            return encode_chat(target, [{"role": "user", "content": inputs}])
        return target.tokenizer(inputs)["input_ids"]
    return list(inputs)


def check_text(text: object, what: str) -> None:
    """Text that UTF-8 can hold: a lone UTF-16 surrogate (from JSON's "\\ud800", say) is
    refused by name instead of failing inside the tokenizer."""
    if isinstance(text, str):
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as error:
            raise VerispecError(f"{what} holds a lone surrogate {text[error.start]!r} at "
                                f"character {error.start}: not text") from None


def encode_chat(target: LoadedModel, messages: list[dict[str, str]]) -> list[int]:
    """Token ids for a conversation ({"role", "content"} dicts) through the model's chat template,
    ready for the assistant's turn."""
    if target.tokenizer is None:
        raise VerispecError(f"{target.name} has no tokenizer: pass token ids instead of text")
    if not target.has_chat_template:
        raise VerispecError(f"{target.name} has no chat template: use a raw prompt")
    for message in messages:
        check_text(message.get("content"), "a message's content")
    return target.chat_ids(messages)


def encode_prompts(target: LoadedModel, inputs: Prompts, chat: bool | None = False
                   ) -> tuple[list[list[int]], bool]:
    """Token ids for one prompt or a batch, and whether it was a batch: a list of strings or of
    id lists, or input_ids [batch, n] with batch > 1. (Left-padded input_ids are not
    unpadded: pass lists of ids of their own lengths.)"""
    if isinstance(inputs, torch.Tensor) and inputs.dim() == 2 and inputs.shape[0] > 1:
        return inputs.tolist(), True
    if isinstance(inputs, (list, tuple)) and inputs and all(isinstance(x, (str, list, tuple))
                                                            for x in inputs):
        return [encode_prompt(target, x, chat) for x in inputs], True
    if isinstance(inputs, (list, tuple)) and any(isinstance(x, (str, list, tuple)) for x in inputs):
        raise VerispecError("a batch is a list of prompts, all text or all lists of token ids")
    return [encode_prompt(target, inputs, chat)], False


def compile_grammars(target: LoadedModel, json_schema: dict | str | list | None, regex: str | list | None,
                     grammar: str | list | None, count: int, batched: bool) -> list[Constraint | None] | None:
    """Each prompt's grammar, compiled (a bad one fails here, before any work): one value
    constrains every prompt; a list gives each prompt of a batch its own (None: unconstrained)."""
    given = {"json_schema": json_schema, "regex": regex, "grammar": grammar}
    if all(value is None for value in given.values()):
        return None
    per_prompt: list[dict] = [{} for _ in range(count)]
    for name, value in given.items():
        if value is None:
            continue
        values = value if isinstance(value, list) else [value] * count
        if isinstance(value, list) and (not batched or len(value) != count):
            raise VerispecError(f"a list of {name} gives one per prompt of a batch: {count} expected, "
                                f"got {len(value)}")
        for kwargs, one in zip(per_prompt, values):
            kwargs[name] = one
    compiled: dict[Grammar, Constraint] = {}
    constraints: list[Constraint | None] = []
    for kwargs in per_prompt:
        spec = Grammar.of(**kwargs)
        if spec is not None and spec not in compiled:
            compiled[spec] = Constraint.compile(spec, target.tokenizer, target.vocab_size,
                                                target.eos_token_ids)
        constraints.append(None if spec is None else compiled[spec])
    return constraints


def encode_predictions(target: LoadedModel, prediction: str | list[str | None] | None, count: int,
                       batched: bool) -> list[list[int] | None] | None:
    """Token ids of the predicted outputs: one text for one prompt, a list of texts (or None
    each) for a batch of `count`."""
    if prediction is None:
        return None
    texts = prediction if isinstance(prediction, list) else [prediction]
    if isinstance(prediction, list) != batched or len(texts) != count:
        raise VerispecError(f"give one prediction per prompt: a text for one prompt, a list of "
                            f"{count} texts (or None) for a batch")
    if target.tokenizer is None:
        raise VerispecError(f"{target.name} has no tokenizer to read a predicted output with")
    ids: list[list[int] | None] = []
    for text in texts:
        if text is not None and not isinstance(text, str):
            raise VerispecError(f"a prediction is text, got {type(text).__name__}")
        if text is not None and not text:
            raise VerispecError("a prediction is empty: give the text the output is expected to be")
        ids.append(None if text is None else target.tokenizer(text, add_special_tokens=False)["input_ids"])
    return ids


def run(target: LoadedModel, request: Request, engine: SpeculativeEngine | None = None,
        streamer=None) -> Results:
    """Execute a request (on `engine`, one built for its method and options, else a new one);
    decode the text when a tokenizer is known. A batch, or several samples of one prompt, runs as
    one batch and gives a list (a prompt's samples together). Beam search gives BeamResults: per
    prompt its n best, best first. A Hugging Face-style `streamer` (put/end) receives the prompt,
    then each committed block of tokens (one sequence only)."""
    if streamer is not None and (request.beams is not None or request.batched or request.sequences > 1):
        raise VerispecError("a streamer takes one sequence: beam search returns whole sequences; stream "
                            "a batch through verispec.serve or SpeculativeEngine.add / step")
    engine = engine or engine_for_checked(target, request.method, request.options)
    if request.beams is not None:
        with about("method"):
            try:
                check_drafter(engine.drafter)
            except VerispecError as error:
                raise VerispecError(f"method {request.method!r} cannot draft for beam search: "
                                    f"{error}") from None
        found = BeamDecoder.of(engine).generate(request.prompts, request.stopping, request.beams)
        results = [result for per_prompt in found for result in per_prompt]
        many = request.batched or request.sequences > 1
    elif request.batched or request.sequences > 1:
        results = engine.generate_batch(request.specs(), request.sequences)
        many = True
    else:
        (spec,) = request.specs()
        if streamer is not None:
            streamer.put(torch.tensor(spec.prompt_ids))
        on_step = None if streamer is None else (lambda step: streamer.put(torch.tensor(step.tokens)))
        results = [engine.generate(spec, on_step)]
        if streamer is not None:
            streamer.end()
        many = False
    if target.tokenizer is not None:
        for result in results:
            result.text = target.tokenizer.decode(result.token_ids, skip_special_tokens=True)
    return results if many else results[0]


def stream(target: LoadedModel, request: Request, engine: SpeculativeEngine | None = None) -> Iterator[str]:
    """Yield one sequence's text piece by piece as its tokens are committed."""
    if request.batched or request.sequences > 1 or request.beams is not None:
        raise VerispecError("stream takes one prompt and one sequence; generate takes batches and beams")
    if target.tokenizer is None:
        raise VerispecError(f"{target.name} has no tokenizer: streaming text needs one")
    engine = engine or engine_for_checked(target, request.method, request.options)
    (spec,) = request.specs()
    yield from stream_text(engine.steps(spec), target.tokenizer)


def stream_text(steps: Iterable[Step], tokenizer) -> Iterator[str]:
    """Turn committed steps into text deltas, holding back incomplete multi-byte characters
    (incrementally: verispec.display.TokenPieces)."""
    pieces = TokenPieces(tokenizer)
    for step in steps:
        text = "".join(pieces.push(step)[0])
        if text:
            yield text
