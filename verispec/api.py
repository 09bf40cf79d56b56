"""`verispec.generate` and `verispec.stream`: Hugging Face `generate()`-shaped entry points.

The speculation method follows from the arguments, as in Hugging Face: `assistant_model` ->
independent draft model, `prompt_lookup_num_tokens` -> prompt lookup, `assistant_early_exit` ->
early exit; none of them -> plain decoding. Outputs are the target's own (lossless).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, replace

import torch
from transformers import PreTrainedModel

from verispec.core.errors import VerispecError
from verispec.core.grammar import Constraint, Grammar
from verispec.core.stopping import StoppingRules
from verispec.core.tree import TreeSettings
from verispec.core.types import GenerationResult, SamplingParams, Step
from verispec.decoding.beam import BeamDecoder, BeamResult, BeamSettings, check_drafter
from verispec.decoding.engine import SpeculativeEngine
from verispec.display import TokenPieces
from verispec.drafters.prediction import PredictionDrafter
from verispec.methods import HF_SELECTORS, PLAIN, build_engine
from verispec.options import DraftOptions
from verispec.target.models import LoadedModel, load

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
        if target.tokenizer is None:
            raise VerispecError(f"{target.name} has no tokenizer: pass token ids instead of text")
        if chat is None:
            chat = bool(getattr(target.tokenizer, "chat_template", None))
        if chat:
            return encode_chat(target, [{"role": "user", "content": inputs}])
        return target.tokenizer(inputs)["input_ids"]
    return list(inputs)


def encode_chat(target: LoadedModel, messages: list[dict[str, str]]) -> list[int]:
    """Token ids for a conversation ({"role", "content"} dicts) through the model's chat template,
    ready for the assistant's turn."""
    if target.tokenizer is None:
        raise VerispecError(f"{target.name} has no tokenizer: pass token ids instead of text")
    if not getattr(target.tokenizer, "chat_template", None):
        raise VerispecError(f"{target.name} has no chat template: use a raw prompt")
    return list(target.tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                     tokenize=True, return_dict=False))


Prompts = str | list[int] | list[str] | list[list[int]] | torch.Tensor


def encode_prompts(target: LoadedModel, inputs: Prompts, chat: bool = False) -> tuple[list[list[int]], bool]:
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


@dataclass(frozen=True)
class Job:
    """A fully validated request: engine, prompts (one, or a batch), stopping rules, sampling."""

    target: LoadedModel
    engine: SpeculativeEngine
    prompts: list[list[int]]
    stopping: StoppingRules
    sampling: SamplingParams
    seed: int | None
    batched: bool = False  # the prompts came as a batch: the result is a list
    samples: int = 1  # sequences per prompt (num_return_sequences)
    predictions: list[list[int] | None] | None = None  # per prompt: its predicted output's ids
    beams: BeamSettings | None = None  # beam search (num_beams > 1) instead of decoding one path
    grammars: list[Constraint | None] | None = None  # per prompt: the grammar its output matches

    @property
    def prompt_ids(self) -> list[int]:
        """The prompt of a single-prompt job."""
        return self.prompts[0]

    @property
    def prediction(self) -> PredictionDrafter | None:
        """A drafter of the predicted output of a single-prompt job."""
        return self.predictors()[0]

    @property
    def constraint(self) -> Constraint | None:
        """A fresh grammar state for a single-prompt job."""
        return self.constraints()[0]

    def constraints(self) -> list[Constraint | None]:
        """A fresh grammar state for each prompt (None: unconstrained)."""
        return [None if c is None else c.copy() for c in self.grammars or [None] * len(self.prompts)]

    def predictors(self) -> list[PredictionDrafter | None]:
        """A drafter of each prompt's predicted output (None: it has none)."""
        ids = self.predictions or [None] * len(self.prompts)
        return [None if p is None else PredictionDrafter(p) for p in ids]


def make_job(target: LoadedModel, inputs: Prompts, *, method: str = PLAIN,
             options: DraftOptions = DraftOptions(), sampling: SamplingParams = SamplingParams(),
             max_new_tokens: int = 128, eos_token_id: int | Iterable[int] | None = None,
             stop_strings: str | Iterable[str] | None = None, chat: bool = False,
             seed: int | None = None, num_return_sequences: int = 1,
             prediction: str | list[str] | None = None, num_beams: int = 1,
             length_penalty: float = 1.0, early_stopping: bool | str = False,
             json_schema: dict | str | list | None = None, regex: str | list | None = None,
             grammar: str | list | None = None) -> Job:
    """Validate a request by method name (the CLI's entry); raises before any work starts."""
    if (isinstance(num_return_sequences, bool) or not isinstance(num_return_sequences, int)
            or num_return_sequences < 1):
        raise VerispecError(f"num_return_sequences must be a positive integer, got {num_return_sequences!r}")
    beams = None
    if num_beams != 1:
        beams = BeamSettings(num_beams, length_penalty, early_stopping, num_return_sequences)
        if sampling.do_sample:
            raise VerispecError("beam search is deterministic: num_beams > 1 takes no sampling "
                                "(do_sample / temperature)")
        if prediction is not None:
            raise VerispecError("beam search takes no prediction: drafts come from the method")
        if any(value is not None for value in (json_schema, regex, grammar)):
            raise VerispecError("beam search takes no grammar (json_schema, regex, grammar)")
    engine = build_engine(target, method, options)
    if beams is not None:
        try:
            check_drafter(engine.drafter)
        except VerispecError as error:
            raise VerispecError(f"method {method!r} cannot draft for beam search: {error}") from None
    eos = target.eos_token_ids if eos_token_id is None else eos_token_id
    stopping = StoppingRules.build(max_new_tokens, eos, stop_strings, target.tokenizer)
    prompts, batched = encode_prompts(target, inputs, chat)
    if not prompts:
        raise VerispecError("the batch of prompts is empty")
    for prompt_ids in prompts:
        engine.check_prompt(prompt_ids, max_new_tokens)
    return Job(target, engine, prompts, stopping, sampling, seed, batched,
               1 if beams else num_return_sequences,
               encode_predictions(target, prediction, len(prompts), batched), beams,
               compile_grammars(target, json_schema, regex, grammar, len(prompts), batched))


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


def encode_predictions(target: LoadedModel, prediction: str | list[str] | None, count: int,
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


def prepare(
    model: ModelLike,
    inputs: str | list[int] | torch.Tensor,
    *,
    max_new_tokens: int = 128,
    do_sample: bool = False,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int | None = None,
    assistant_model: ModelLike | None = None,
    num_assistant_tokens: int | None = None,
    num_assistant_tokens_schedule: str | None = None,
    assistant_confidence_threshold: float | None = None,
    prompt_lookup_num_tokens: int | None = None,
    max_matching_ngram_size: int | None = None,
    assistant_early_exit: int | None = None,
    tree: TreeSettings | str | None = None,
    acceptance: str | None = None,
    method: str | None = None,
    options: DraftOptions | None = None,
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
) -> Job:
    """Map Hugging Face-style arguments to a method and validate; see `generate`."""
    target = _as_loaded(model, tokenizer)
    selectors = {"assistant_model": assistant_model, "prompt_lookup_num_tokens": prompt_lookup_num_tokens,
                 "assistant_early_exit": assistant_early_exit}
    chosen = [name for name, value in selectors.items() if value is not None]
    if method is not None:
        chosen.append(f"method={method!r}")
    if len(chosen) > 1:
        raise VerispecError(f"choose one speculation method, got {' and '.join(chosen)}")
    if options is not None and not chosen:
        raise VerispecError("options= sets a method's settings: give method= too")
    # Hugging Face-style keywords for DraftOptions fields: given ones apply, and may not
    # contradict a field options= sets.
    keywords = {"num_assistant_tokens": ("k", num_assistant_tokens),
                "num_assistant_tokens_schedule": ("schedule", num_assistant_tokens_schedule),
                "assistant_confidence_threshold": ("confidence_threshold", assistant_confidence_threshold),
                "max_matching_ngram_size": ("max_ngram", max_matching_ngram_size),
                "tree": ("tree", tree), "acceptance": ("acceptance", acceptance)}
    if prompt_lookup_num_tokens is not None:
        keywords["prompt_lookup_num_tokens"] = ("k", prompt_lookup_num_tokens)
    if assistant_early_exit is not None:
        keywords["assistant_early_exit"] = ("exit_layer", assistant_early_exit)
    if assistant_model is not None:
        draft = assistant_model if isinstance(assistant_model, (str, LoadedModel)) else _as_loaded(
            assistant_model, target.tokenizer)
        keywords["assistant_model"] = ("draft", draft)
    options = options or DraftOptions()
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
    options = replace(options, **{name: value for name, (_, value) in given.items()})
    if method is None:
        method = HF_SELECTORS[chosen[0]] if chosen else PLAIN
    return make_job(target, inputs, method=method, options=options,
                    sampling=SamplingParams(do_sample, temperature, top_k, top_p),
                    max_new_tokens=max_new_tokens, eos_token_id=eos_token_id,
                    stop_strings=stop_strings, chat=chat, seed=seed,
                    num_return_sequences=num_return_sequences, prediction=prediction,
                    num_beams=num_beams, length_penalty=length_penalty, early_stopping=early_stopping,
                    json_schema=json_schema, regex=regex, grammar=grammar)


Results = GenerationResult | list[GenerationResult] | BeamResult | list[BeamResult]


def run(job: Job, streamer=None) -> Results:
    """Execute a prepared job; decode the text when a tokenizer is known. A batch, or several
    samples of one prompt, runs as one batch and gives a list (samples of a prompt together).
    Beam search gives BeamResults: per prompt its num_return_sequences best, best first."""
    if job.beams is not None:
        return run_beams(job, streamer)
    if job.batched or job.samples > 1:
        if streamer is not None:
            raise VerispecError("a streamer takes one sequence: stream a batch through verispec.serve "
                                "or SpeculativeEngine.add / step")
        results = job.engine.generate_batch(job.prompts, job.stopping, job.sampling, job.seed,
                                            job.samples, job.predictors(), job.constraints())
    elif streamer is None:
        results = [job.engine.generate(job.prompt_ids, job.stopping, job.sampling, job.seed,
                                       prediction=job.prediction, constraint=job.constraint)]
    else:
        streamer.put(torch.tensor(job.prompt_ids))
        results = [job.engine.generate(job.prompt_ids, job.stopping, job.sampling, job.seed,
                                       on_step=lambda step: streamer.put(torch.tensor(step.tokens)),
                                       prediction=job.prediction, constraint=job.constraint)]
        streamer.end()
    if job.target.tokenizer is not None:
        for result in results:
            result.text = job.target.tokenizer.decode(result.token_ids, skip_special_tokens=True)
    return results if job.batched or job.samples > 1 else results[0]


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
    num_return_sequences (n sequences per prompt sharing its prefill, a prompt's together in
    the list; with a seed, sequence i is seeded with seed + i). verispec adds method=NAME (any
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
    return run(prepare(model, inputs, **kwargs), streamer)


def run_beams(job: Job, streamer=None) -> BeamResult | list[BeamResult]:
    """Speculative beam search (verispec.decoding.beam): the same sequences and scores as plain beam
    search of the target, several search steps per target pass where the drafts allow."""
    if streamer is not None:
        raise VerispecError("a streamer takes one sequence; beam search returns whole sequences")
    found = BeamDecoder.of(job.engine).generate(job.prompts, job.stopping, job.beams)
    results = [result for per_prompt in found for result in per_prompt]
    if job.target.tokenizer is not None:
        for result in results:
            result.text = job.target.tokenizer.decode(result.token_ids, skip_special_tokens=True)
    return results if job.batched or job.beams.num_return_sequences > 1 else results[0]


def stream(model: ModelLike, inputs: str | list[int] | torch.Tensor, **kwargs) -> Iterator[str]:
    """Yield the generated text piece by piece as tokens are committed (same arguments)."""
    job = prepare(model, inputs, **kwargs)
    if job.batched or job.samples > 1:
        raise VerispecError("stream takes one prompt and one sequence; generate takes batches")
    if job.target.tokenizer is None:
        raise VerispecError(f"{job.target.name} has no tokenizer: streaming text needs one")
    yield from stream_text(job.engine.steps(job.prompt_ids, job.stopping, job.sampling, job.seed,
                                            job.prediction, job.constraint), job.target.tokenizer)


def stream_text(steps: Iterable[Step], tokenizer) -> Iterator[str]:
    """Turn committed steps into text deltas, holding back incomplete multi-byte characters
    (incrementally: verispec.display.TokenPieces)."""
    pieces = TokenPieces(tokenizer)
    for step in steps:
        text = "".join(pieces.push(step)[0])
        if text:
            yield text
