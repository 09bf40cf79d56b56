"""Request bodies: their shape (pydantic, strict types, every number range-checked), then what
they mean for the engine.

Every problem becomes a BadRequest (400 with OpenAI's error shape, naming the field) before any
work is queued. OpenAI fields the server cannot honour are refused by name (REFUSED), never
silently dropped; those that change nothing (user, metadata, store, ...) are ignored.
"""

from __future__ import annotations

import json
import re
from dataclasses import replace
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from verispec.core.errors import VerispecError
from verispec.core.tree import TreeSettings
from verispec.core.types import SamplingParams
from verispec.methods import TREE_METHODS
from verispec.model.loading import LoadedModel
from verispec.options import DraftOptions, parse_tree
from verispec.request import Request, about, build_request, encode_chat, encode_prompt

DEFAULT_MAX_TOKENS = 256  # when a request gives none (clipped to the room left in the context)
MAX_K = 64  # longer drafts only cost: every method's measured best is under 16
MAX_TREE_NODES = 64  # a tree's draft nodes (the measured best trees have 16 to 32)
MAX_TREE_TOPK = 16  # a tree's children per expanded node
MAX_STOPS = 4  # OpenAI's limit
MAX_STOP_CHARS = 256  # per stop string
MAX_TOP_LOGPROBS = 20  # OpenAI's limit (chat's top_logprobs; completions' logprobs: 5)
MAX_DEPTH = 32  # JSON nesting (the deepest valid body nests 5)
MAX_GRAMMAR_CHARS = 100_000  # a regex or Lark grammar
MAX_INT = 2**63 - 1
SEED_RANGE = (-(2**63), 2**64 - 1)  # what torch.Generator.manual_seed takes

SURROGATE = re.compile("[\ud800-\udfff]")  # left in a str by json.loads only when lone

Int = Annotated[int, Field(ge=-MAX_INT, le=MAX_INT)]


class BadRequest(Exception):
    """A request the server refuses (400); `param` names the offending field when known."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class StreamOptions(_Body):
    include_usage: bool = False


class TextPart(_Body):
    type: Literal["text"]
    text: str


class Prediction(_Body):
    """OpenAI's predicted output: {"type": "content", "content": text or text parts}."""

    type: Literal["content"]
    content: Annotated[str, Field(min_length=1)] | Annotated[list[TextPart], Field(min_length=1)]

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class JsonSchemaFormat(_Body):
    """OpenAI's response_format.json_schema: the schema under "schema" (name and strict are
    accepted; the output always matches the schema exactly)."""

    model_config = ConfigDict(extra="ignore", strict=True, populate_by_name=True)
    name: str | None = None
    json_schema: dict = Field(alias="schema")
    strict: bool | None = None


class ResponseFormat(_Body):
    """OpenAI's response_format: text, any JSON object, or JSON matching a schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    def schema(self) -> dict | None:
        """The JSON schema the output matches (None: any text); json_object: any JSON object."""
        if self.type == "text":
            return None
        if self.type == "json_object":
            return {"type": "object"}
        if self.json_schema is None:
            raise BadRequest("response_format of type json_schema needs json_schema.schema",
                             "response_format")
        return self.json_schema.json_schema


class Message(_Body):
    role: Literal["system", "user", "assistant", "developer"]
    content: str | list[TextPart]

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class Common(_Body):
    """Fields both endpoints share: OpenAI's sampling fields and verispec's own."""

    model: str | None = None
    temperature: Annotated[float, Field(ge=0, le=100, allow_inf_nan=False)] = 1.0
    top_p: Annotated[float, Field(gt=0, le=1, allow_inf_nan=False)] = 1.0
    top_k: Annotated[int, Field(ge=0, le=MAX_INT)] = 0  # as vLLM: an extra field (0: off)
    max_tokens: Annotated[int, Field(ge=1, le=MAX_INT)] | None = None
    stop: str | Annotated[list[str], Field(max_length=MAX_STOPS)] | None = None
    seed: Annotated[int, Field(ge=SEED_RANGE[0], le=SEED_RANGE[1])] | None = None
    n: Annotated[int, Field(ge=1, le=MAX_INT)] = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: Annotated[float, Field(ge=-2, le=2, allow_inf_nan=False)] = 0.0
    frequency_penalty: Annotated[float, Field(ge=-2, le=2, allow_inf_nan=False)] = 0.0
    logit_bias: dict[str, Annotated[float, Field(ge=-100, le=100, allow_inf_nan=False)]] | None = None
    method: str | None = None  # verispec: the speculation method (default: the server's first)
    k: Annotated[int, Field(ge=0, le=MAX_K)] | None = None  # verispec: draft length (default: the method's)
    # verispec: EAGLE's depth behind a lookup (eagle-pld, eagle-suffix; default: the profile's)
    model_k: Annotated[int, Field(ge=1, le=MAX_K)] | None = None
    tree: Annotated[str, Field(max_length=32)] | None = None  # verispec: TOPKxNODES or "default"
    prediction: Prediction | None = None  # OpenAI's predicted outputs
    response_format: ResponseFormat | None = None  # OpenAI's structured output
    regex: Annotated[str, Field(min_length=1, max_length=MAX_GRAMMAR_CHARS)] | None = None  # verispec
    grammar: Annotated[str, Field(min_length=1, max_length=MAX_GRAMMAR_CHARS)] | None = None  # Lark

    def grammar_fields(self) -> tuple[str | None, dict]:
        """The one body field naming a grammar (None: none) and verispec.request.build_request's
        keyword for it."""
        schema = None if self.response_format is None else self.response_format.schema()
        named = {name: {key: value} for name, key, value in (
            ("response_format", "json_schema", schema), ("regex", "regex", self.regex),
            ("grammar", "grammar", self.grammar)) if value is not None}
        if len(named) > 1:
            raise BadRequest(f"give one of response_format, regex and grammar, got {' and '.join(named)}",
                             next(iter(named)))
        return next(iter(named.items()), (None, {}))

    def logprobs_wanted(self) -> int | None:
        """None: no logprobs; else the top alternatives wanted per token."""
        raise NotImplementedError


class ChatBody(Common):
    messages: Annotated[list[Message], Field(min_length=1)]
    max_completion_tokens: Annotated[int, Field(ge=1, le=MAX_INT)] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None

    def logprobs_wanted(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise BadRequest("top_logprobs needs logprobs: true", "top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionBody(Common):
    prompt: str | Annotated[list[Annotated[int, Field(ge=0, le=MAX_INT)]], Field(min_length=1)]
    logprobs: Annotated[int, Field(ge=0, le=5)] | None = None  # OpenAI's legacy field: top alternatives

    def logprobs_wanted(self) -> int | None:
        return self.logprobs


# OpenAI fields this server does not act on, refused (400 naming the field) whenever a request
# gives them a value that would change the answer; field -> (is that value harmless, why).
REFUSED: dict[str, tuple[Any, str]] = {
    "tools": (lambda v: not v, "tool calls are not supported"),
    "tool_choice": (lambda v: v in (None, "none"), "tool calls are not supported"),
    "functions": (lambda v: not v, "function calls are not supported"),
    "function_call": (lambda v: v in (None, "none"), "function calls are not supported"),
    "logit_bias": (lambda v: not v, "logit_bias is not supported (it would have to bias target "
                   "and drafts alike to keep acceptance exact)"),
    "presence_penalty": (lambda v: v == 0, "presence_penalty is not supported; give 0"),
    "frequency_penalty": (lambda v: v == 0, "frequency_penalty is not supported; give 0"),
    "echo": (lambda v: not v, "echo is not supported"),
    "suffix": (lambda v: not v, "suffix is not supported"),
    "best_of": (lambda v: v in (None, 1), "best_of is not supported; use n"),
    "audio": (lambda v: v is None, "audio output is not supported"),
    "modalities": (lambda v: v in (None, ["text"]), "only text output is supported"),
}


def refuse_unsupported(data: dict) -> None:
    """BadRequest for the first field of REFUSED given a value this server cannot honour."""
    for name, (harmless, why) in REFUSED.items():
        if name in data and not harmless(data[name]):
            raise BadRequest(f"{name}: {why}", name)


def _depth(data: object) -> int:
    """How deeply `data` (parsed JSON) nests, without recursion."""
    deepest, stack = 0, [(data, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, (dict, list)):
            deepest = max(deepest, depth)
            if depth <= MAX_DEPTH:
                stack.extend((child, depth + 1) for child in (item.values() if isinstance(item, dict)
                                                              else item))
    return deepest


def _lone_surrogate(data: dict) -> str | None:
    """The top-level field of `data` (parsed JSON) holding a lone UTF-16 surrogate in a string or
    key, written with backslash escapes (None: none). JSON's \\ud800 escapes spell them; they are
    no text (the tokenizer raises on them, UTF-8 cannot encode them)."""
    for field, value in data.items():
        stack = [field, value]
        while stack:
            item = stack.pop()
            if isinstance(item, str) and SURROGATE.search(item):
                return field.encode("utf-8", "backslashreplace").decode()
            if isinstance(item, dict):
                stack.extend(item.keys())
                stack.extend(item.values())
            elif isinstance(item, list):
                stack.extend(item)
    return None


def _no_constant(name: str) -> None:
    raise ValueError(f"{name} is not a JSON number")


def parse_body(raw: bytes, kind: type[Common]) -> Common:
    """JSON text -> a typed body, or BadRequest naming the field."""
    try:
        data = json.loads(raw, parse_constant=_no_constant)
    except RecursionError:
        raise BadRequest(f"the body nests deeper than {MAX_DEPTH} levels") from None
    except (ValueError, UnicodeDecodeError) as error:
        raise BadRequest(f"the body is not valid JSON: {error}") from None
    if not isinstance(data, dict):
        raise BadRequest("the body must be a JSON object")
    if _depth(data) > MAX_DEPTH:
        raise BadRequest(f"the body nests deeper than {MAX_DEPTH} levels")
    field = _lone_surrogate(data)
    if field is not None:
        raise BadRequest(f"{field}: holds a lone UTF-16 surrogate (\\ud800-\\udfff), which is no text", field)
    refuse_unsupported(data)
    try:
        return kind.model_validate(data)
    except ValidationError as error:
        errors = error.errors()
        param = str(errors[0]["loc"][0]) if errors[0]["loc"] else None  # the top-level field
        # A field of several types (stop: a string or a list) fails once per type: say each.
        said = [f"{'.'.join(str(part) for part in e['loc'])}: {e['msg']}" for e in errors
                if e["loc"][:1] == errors[0]["loc"][:1]]
        raise BadRequest("; ".join(said[:3]), param) from None


# verispec.request's field names -> the body's (None: the same name)
BODY_FIELDS = {"max_new_tokens": "max_tokens", "sequences": "n", "num_beams": None}


def to_request(body: Common, target: LoadedModel, methods: list[str], max_n: int,
               defaults: DraftOptions = DraftOptions()) -> Request:
    """The request a parsed body asks for (verispec.request.build_request validates it); a
    BadRequest naming the body field at fault. methods: those served, the first the default;
    defaults: the server's drafting options, which a body's k, model_k and tree override."""
    method = body.method or methods[0]
    if body.n > max_n:
        raise BadRequest(f"n is at most {max_n} (the server's --max-batch), got {body.n}", "n")
    chat = isinstance(body, ChatBody)
    prompt_field = "messages" if chat else "prompt"
    grammar_field, grammar = body.grammar_fields()
    try:
        if chat:
            if not any(m.text().strip() for m in body.messages):
                raise VerispecError("the messages are empty: give some text", field="prompt")
            with about("prompt"):
                messages = [{"role": m.role, "content": m.text()} for m in body.messages]
                prompt_ids = encode_chat(target, messages)
        else:
            with about("prompt"):
                prompt_ids = encode_prompt(target, body.prompt)
        with about("tree"):
            tree = (parse_tree(body.tree) if body.tree is not None
                    else defaults.tree if method in TREE_METHODS else None)
        max_tokens = getattr(body, "max_completion_tokens", None) or body.max_tokens
        if max_tokens is None:
            max_tokens = max(1, min(DEFAULT_MAX_TOKENS, target.context_length - len(prompt_ids)))
        stops = [body.stop] if isinstance(body.stop, str) else body.stop or []
        if any(len(stop) > MAX_STOP_CHARS for stop in stops):
            raise VerispecError(f"a stop string has at most {MAX_STOP_CHARS} characters", field="stop")
        request = build_request(
            target, prompt_ids, method=method,
            options=replace(defaults, k=defaults.k if body.k is None else body.k, tree=tree,
                            model_k=defaults.model_k if body.model_k is None else body.model_k),
            sampling=SamplingParams.of(body.temperature, body.top_k, body.top_p),
            max_new_tokens=max_tokens, stop_strings=body.stop, seed=body.seed, sequences=body.n,
            prediction=None if body.prediction is None else body.prediction.text(),
            logprobs=body.logprobs_wanted(), methods=methods, **grammar)
        tree = request.options.tree
        if isinstance(tree, TreeSettings) and (tree.nodes > MAX_TREE_NODES or tree.topk > MAX_TREE_TOPK):
            raise VerispecError(f"a tree has at most {MAX_TREE_TOPK} children per node and "
                                f"{MAX_TREE_NODES} nodes here, got {body.tree}", field="tree")
    except VerispecError as error:
        field = {"prompt": prompt_field, "grammar": grammar_field}.get(error.field, error.field)
        raise BadRequest(str(error), BODY_FIELDS.get(field, field)) from None
    return request
