"""Request bodies: their shape (pydantic, strict types), then what they mean for the engine.

Every problem becomes a BadRequest (400 with OpenAI's error shape) before any work is queued.
OpenAI fields the server does not act on (user, logprobs=false, ...) are ignored.
"""

from __future__ import annotations

import json
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from verispec.api import encode_chat, encode_predictions, encode_prompt
from verispec.engine import context_length
from verispec.errors import VerispecError
from verispec.methods import resolve_tree
from verispec.models import LoadedModel
from verispec.options import DraftOptions, parse_tree
from verispec.server.scheduler import GenerationRequest
from verispec.stopping import StoppingRules
from verispec.types import SamplingParams

DEFAULT_MAX_TOKENS = 256  # when a request gives none (clipped to the room left in the context)
MAX_K = 64  # longer drafts only cost: every method's measured best is under 16


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


class Message(_Body):
    role: Literal["system", "user", "assistant", "developer"]
    content: str | list[TextPart]

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class Common(_Body):
    """Fields both endpoints share: OpenAI's sampling fields and verispec's own."""

    model: str | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: Annotated[int, Field(ge=0)] = 0  # as vLLM: an extra field (0: off)
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    stop: str | Annotated[list[str], Field(max_length=4)] | None = None
    seed: int | None = None
    n: Annotated[int, Field(ge=1)] = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    method: str | None = None  # verispec: the speculation method (default: the server's first)
    k: Annotated[int, Field(ge=0, le=MAX_K)] | None = None  # verispec: draft length (default: the method's)
    tree: str | None = None  # verispec: TOPKxNODES or "default"
    prediction: Prediction | None = None  # OpenAI's predicted outputs


class ChatBody(Common):
    messages: Annotated[list[Message], Field(min_length=1)]
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None


class CompletionBody(Common):
    prompt: str | Annotated[list[int], Field(min_length=1)]


def parse_body(raw: bytes, kind: type[Common]) -> Common:
    """JSON text -> a typed body, or BadRequest naming the field."""
    try:
        data = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as error:
        raise BadRequest(f"the body is not valid JSON: {error}") from None
    if not isinstance(data, dict):
        raise BadRequest("the body must be a JSON object")
    try:
        return kind.model_validate(data)
    except ValidationError as error:
        first = error.errors()[0]
        param = ".".join(str(part) for part in first["loc"])
        raise BadRequest(f"{param}: {first['msg']}", param or None) from None


def build_request(body: Common, target: LoadedModel, methods: list[str], max_n: int,
                  check_prompt) -> GenerationRequest:
    """The engine's request for a parsed body; check_prompt(ids, max_new_tokens) is the engine's."""
    method = body.method or methods[0]
    if method not in methods:
        raise BadRequest(f"method {method!r} is not served here; choose from {', '.join(methods)}",
                         "method")
    if body.n > max_n:
        raise BadRequest(f"n is at most {max_n} (the server's --max-batch), got {body.n}", "n")
    param = "prompt"
    try:
        if isinstance(body, ChatBody):
            param = "messages"
            if not any(m.text().strip() for m in body.messages):
                raise VerispecError("the messages are empty: give some text")
            prompt_ids = encode_chat(target, [{"role": m.role, "content": m.text()} for m in body.messages])
        else:
            prompt_ids = encode_prompt(target, body.prompt)
        param = None  # SamplingParams names the field in its message
        sampling = SamplingParams(do_sample=body.temperature > 0, temperature=body.temperature,
                                  top_k=body.top_k, top_p=body.top_p)
        param = "tree"
        tree = resolve_tree(method, None if body.tree is None else parse_tree(body.tree))
        param = "max_tokens"
        max_tokens = getattr(body, "max_completion_tokens", None) or body.max_tokens
        if max_tokens is None:
            room = context_length(target.model) - len(prompt_ids)
            max_tokens = max(1, min(DEFAULT_MAX_TOKENS, room))
        check_prompt(prompt_ids, max_tokens)
        param = "stop"
        stopping = StoppingRules.build(max_tokens, target.eos_token_ids, body.stop, target.tokenizer)
        param = "prediction"
        prediction = None if body.prediction is None else encode_predictions(
            target, body.prediction.text(), 1, False)[0]
    except VerispecError as error:
        raise BadRequest(str(error), param) from None
    return GenerationRequest(prompt_ids, stopping, sampling, body.seed, body.n, method,
                   DraftOptions(k=body.k, tree=tree), prediction)
