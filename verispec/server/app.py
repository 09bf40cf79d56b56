"""`verispec serve`: an OpenAI-compatible HTTP API over the batched engine, with Prometheus
metrics and a playground page.

Requests pass the door first (Door: Host, API key, content type, body size), are validated
(400 before any work; tokenized off the event loop), then queued for the scheduler's thread,
which admits them into the running batch between steps while the batch and the KV budget have
room; each step of each sequence comes back as an event and goes out as a server-sent event
(streaming) or is collected (not). Every error is OpenAI-shaped JSON: {"error": {"message",
"type", "param", "code"}}.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import uvicorn
from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import FileResponse, JSONResponse, Response, StreamingResponse
from fastapi.staticfiles import StaticFiles
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException
from starlette.middleware.cors import CORSMiddleware

from verispec.core.errors import VerispecError
from verispec.core.types import GenerationStats, TokenLogprob
from verispec.methods import DEFAULT_METHOD, METHODS, PLAIN
from verispec.model.loading import LoadedModel
from verispec.options import DraftOptions
from verispec.request import Request as GenerationRequest
from verispec.server.metrics import Metrics
from verispec.server.requests import BadRequest, ChatBody, Common, CompletionBody, parse_body, to_request
from verispec.server.scheduler import (
    Admitted,
    Failed,
    QueueFull,
    Refused,
    Scheduler,
    ShuttingDown,
    Stepped,
    Ticket,
)
from verispec.server.text import TextStream

log = logging.getLogger("verispec.server")
STATIC = Path(__file__).parent / "static"
RETRY_AFTER_SECONDS = 1  # told to clients refused with 429 (queue full)
MAX_BODY_BYTES = 1 << 20  # default body limit: a full 8k-token context is about 40 kB of text
LOOPBACK = ("127.0.0.1", "localhost", "::1", "[::1]")
OPEN_PATHS = ("/health", "/metrics")  # answered without the API key


def error_response(status: int, message: str, kind: str, param: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    """OpenAI's error shape."""
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": status}},
                        status_code=status, headers=headers)


class _Output:
    """One request's response as its steps arrive: text, per-token fates, statistics."""

    def __init__(self, chat: bool, request: GenerationRequest, tokenizer, model: str) -> None:
        self.chat, self.request = chat, request
        self.id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created, self.model = int(time.time()), model
        self.texts = [TextStream(tokenizer, request.stopping.stop_strings) for _ in range(request.sequences)]
        self.stats = [GenerationStats() for _ in range(request.sequences)]
        self.reasons: list[str | None] = [None] * request.sequences
        self.contents = [""] * request.sequences  # the response text of each choice so far
        self.logprobs: list[list[TokenLogprob]] = [[] for _ in range(request.sequences)]
        self.tokenizer = tokenizer
        self.started = time.perf_counter()

    @property
    def done(self) -> bool:
        return all(self.reasons)

    def add(self, event: Stepped) -> dict:
        """Record a step; the stream chunk for it."""
        i, step = event.index, event.step
        first = not self.stats[i].target_forwards
        self.stats[i].add(step)
        pieces, rejected = self.texts[i].push(step)
        self.reasons[i] = event.finish_reason
        delta = self.texts[i].content(final=event.finish_reason is not None)
        self.contents[i] += delta
        if self.chat:
            choice = {"index": i, "delta": {"role": "assistant", "content": delta} if first
                      else {"content": delta}}
        else:
            choice = {"index": i, "text": delta}
        self.logprobs[i] += step.logprobs or []
        choice |= {"finish_reason": event.finish_reason, "logprobs": self._logprobs(step.logprobs)}
        extra = {"tokens": pieces, "fates": [fate.value for fate in step.fates], "rejected": rejected,
                 "drafted": step.num_drafted}
        if self.done:
            extra["summary"] = self.summary()
        return self._envelope([choice]) | {"verispec": extra}

    def _logprobs(self, logprobs: list[TokenLogprob] | None) -> dict | None:
        """OpenAI's logprobs block for these tokens (chat's or completions' shape)."""
        if logprobs is None or self.request.logprobs is None:
            return None
        piece = self.tokenizer.decode
        if self.chat:
            def entry(token: int, logprob: float) -> dict:
                text = piece([token])
                return {"token": text, "logprob": logprob, "bytes": list(text.encode())}
            return {"content": [entry(t.token, t.logprob) | {
                "top_logprobs": [entry(token, value) for token, value in t.top]} for t in logprobs]}
        return {"tokens": [piece([t.token]) for t in logprobs],
                "token_logprobs": [t.logprob for t in logprobs],
                "top_logprobs": [{piece([token]): value for token, value in t.top} for t in logprobs]}

    def _envelope(self, choices: list[dict], streaming: bool = True) -> dict:
        kind = "text_completion"
        if self.chat:
            kind = "chat.completion.chunk" if streaming else "chat.completion"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model,
                "choices": choices}

    def summary(self) -> dict:
        """The verispec block: method, tau, acceptance by position, draft and verify seconds."""
        total = GenerationStats.total(self.stats)
        total.total_seconds = time.perf_counter() - self.started
        return {"method": self.request.method, **total.as_dict()}

    def usage(self) -> dict:
        completion = sum(s.new_tokens for s in self.stats)
        prompt = len(self.request.prompts[0])
        details = {"accepted_prediction_tokens": sum(s.accepted_prediction_tokens for s in self.stats),
                   "rejected_prediction_tokens": sum(s.rejected_prediction_tokens for s in self.stats)}
        return {"prompt_tokens": prompt, "completion_tokens": completion,
                "total_tokens": prompt + completion, "completion_tokens_details": details}

    def response(self) -> dict:
        """The whole (non-streaming) response."""
        choices = []
        for i, content in enumerate(self.contents):
            body = ({"message": {"role": "assistant", "content": content}} if self.chat
                    else {"text": content})
            choices.append({"index": i, **body, "finish_reason": self.reasons[i],
                            "logprobs": self._logprobs(self.logprobs[i])})
        return self._envelope(choices, streaming=False) | {"usage": self.usage(),
                                                            "verispec": self.summary()}

    def usage_chunk(self) -> dict:
        return self._envelope([]) | {"usage": self.usage()}


class _TicketStream(StreamingResponse):
    """A streaming response that cancels its request's work however it ends (a client that
    disconnects mid-stream frees its rows at the next step)."""

    def __init__(self, content: AsyncIterator[str], scheduler: Scheduler, ticket: Ticket) -> None:
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.scheduler, self.ticket = scheduler, ticket

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.scheduler.cancel(self.ticket)


def _sse(data: dict | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"


class Door:
    """ASGI middleware: what every request must pass before any handler reads it.

    - Host: when the server listens on a loopback address, the Host header must name one
      (a web page the user visits could otherwise reach it through DNS rebinding);
    - API key: with one set, every path but /health and /metrics needs
      `Authorization: Bearer KEY` (compared in constant time), else 401;
    - POSTs must be `application/json` (415) and at most max_body bytes by Content-Length (413;
      a body sent without one is counted as it is read: read_body).
    """

    def __init__(self, app, api_key: str | None, check_host: bool, max_body: int) -> None:
        self.app, self.check_host, self.max_body = app, check_host, max_body
        self.api_key = None if api_key is None else f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http":
            refusal = self._refusal(scope)
            if refusal is not None:
                await refusal(scope, receive, send)
                return
        await self.app(scope, receive, send)

    def _refusal(self, scope) -> Response | None:
        headers = {name.decode("latin-1").lower(): value for name, value in scope["headers"]}
        if self.check_host:
            host = headers.get("host", b"").decode("latin-1").lower()
            name = host.rsplit(":", 1)[0] if not host.startswith("[") else host.split("]")[0] + "]"
            if name not in LOOPBACK:
                return error_response(400, f"the Host header {host!r} is not this server's (it "
                                      "listens on a loopback address)", "invalid_request_error", "Host")
        if self.api_key is not None and scope["path"] not in OPEN_PATHS and scope["method"] != "OPTIONS":
            if not hmac.compare_digest(headers.get("authorization", b""), self.api_key):
                return error_response(401, "a valid API key is required (Authorization: Bearer KEY)",
                                      "authentication_error",
                                      headers={"WWW-Authenticate": "Bearer"})
        if scope["method"] == "POST":
            kind = headers.get("content-type", b"").decode("latin-1").split(";")[0].strip().lower()
            if kind != "application/json":
                return error_response(415, f"the body must be application/json, got {kind or 'none'!r}",
                                      "invalid_request_error", "Content-Type")
            length = headers.get("content-length", b"0")
            if not length.isdigit() or int(length) > self.max_body:
                return error_response(413, f"the body is over the server's limit of {self.max_body} "
                                      "bytes", "invalid_request_error")
        return None


async def read_body(http: Request, limit: int) -> bytes:
    """The request's body, refusing (413) one that grows past `limit` bytes as it arrives."""
    chunks, size = [], 0
    async for chunk in http.stream():
        size += len(chunk)
        if size > limit:
            raise HTTPException(413, f"the body is over the server's limit of {limit} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


@dataclass(frozen=True)
class Served:
    """What the routes read (app.state.served): the model, its scheduler and metrics, and the
    settings create_app was given."""

    target: LoadedModel
    scheduler: Scheduler
    metrics: Metrics
    methods: list[str]  # those requests may choose, the first the default
    max_batch: int
    max_body: int
    options: DraftOptions  # the drafting options requests get (their own k and tree override them)

    def unavailable(self) -> JSONResponse:
        """503: draining, or the engine thread has died (then nothing will ever be answered)."""
        if self.scheduler.died is not None:
            return error_response(503, f"the server's engine thread died "
                                  f"({type(self.scheduler.died).__name__}); restart the server",
                                  "server_error")
        return error_response(503, "the server is shutting down", "server_error")


def served(http: Request) -> Served:
    return http.app.state.served


routes = APIRouter()


@routes.get("/health")
async def health(http: Request) -> JSONResponse:
    scheduler = served(http).scheduler
    if not scheduler.accepting:
        return served(http).unavailable()
    return JSONResponse({"status": "ok", "running": scheduler.running,
                         "kv_tokens": {"reserved": scheduler.reserved_kv_tokens,
                                       "budget": scheduler.max_kv_tokens}})


@routes.get("/v1/models")
async def models(http: Request) -> dict:
    state = served(http)
    return {"object": "list", "data": [{
        "id": state.target.name, "object": "model", "created": 0, "owned_by": "verispec",
        "verispec": {"methods": state.methods, "default_method": state.methods[0]}}]}


@routes.get("/metrics")
async def prometheus(http: Request) -> Response:
    return Response(served(http).metrics.render(), media_type=CONTENT_TYPE_LATEST)


@routes.get("/")
async def playground() -> FileResponse:
    return FileResponse(STATIC / "index.html")


@routes.post("/v1/chat/completions")
async def chat_completions(http: Request) -> Response:
    return await generate(http, ChatBody)


@routes.post("/v1/completions")
async def completions(http: Request) -> Response:
    return await generate(http, CompletionBody)


async def generate(http: Request, kind: type[Common]) -> Response:
    """A completion: the body read, checked and tokenized, the request queued; its answer whole,
    or streamed as its steps arrive."""
    state = served(http)
    scheduler, metrics = state.scheduler, state.metrics
    if not scheduler.accepting:  # before reading or tokenizing anything
        metrics.rejected.labels("shutting_down").inc()
        return state.unavailable()
    raw = await read_body(http, state.max_body)
    # Parsing and tokenizing a big body takes milliseconds: off the event loop.
    body = await asyncio.to_thread(parse_body, raw, kind)
    request = await asyncio.to_thread(to_request, body, state.target, state.methods, state.max_batch,
                                      state.options)
    try:
        scheduler.check_fits(request)
    except VerispecError as error:
        raise BadRequest(str(error), "max_tokens") from None
    try:
        ticket = scheduler.submit(request)
    except QueueFull:
        metrics.rejected.labels("queue_full").inc()
        return error_response(429, "the server's queue is full; retry shortly", "rate_limit_error",
                              headers={"Retry-After": str(RETRY_AFTER_SECONDS)})
    except ShuttingDown:
        metrics.rejected.labels("shutting_down").inc()
        return state.unavailable()
    # Until the response starts (and for all of a non-streaming one) a watcher cancels the
    # work the moment the client disconnects; a stream's own end cancels it after that.
    watcher = asyncio.create_task(_cancel_on_disconnect(http, scheduler, ticket))
    streaming = None
    try:
        first = await ticket.events.get()
        if isinstance(first, Refused):
            raise BadRequest(first.message)
        if not isinstance(first, Admitted):
            return _gone_or_failed(first)
        output = _Output(kind is ChatBody, request, state.target.tokenizer, body.model or state.target.name)
        if body.stream:
            include_usage = body.stream_options is not None and body.stream_options.include_usage
            streaming = _TicketStream(_stream(ticket, output, include_usage), scheduler, ticket)
            return streaming
        while not output.done:
            event = await ticket.events.get()
            if not isinstance(event, Stepped):
                return _gone_or_failed(event)
            output.add(event)
        return JSONResponse(output.response())
    finally:
        watcher.cancel()
        if streaming is None:  # else the stream cancels it when it ends
            scheduler.cancel(ticket)  # a no-op once every sequence has finished


async def _stream(ticket: Ticket, output: _Output, include_usage: bool) -> AsyncIterator[str]:
    """The stream's events; one that fails ends with an error event, then [DONE]."""
    try:
        while not output.done:
            event = await ticket.events.get()
            if event is None:  # the client went away before the stream began
                return
            if isinstance(event, Failed):
                yield _sse({"error": {"message": event.message, "type": "server_error",
                                      "param": None, "code": event.status}})
                break
            yield _sse(output.add(event))
        else:
            if include_usage:
                yield _sse(output.usage_chunk())
    except Exception as error:  # a bug here: the client still gets an ending
        log.error("stream: unexpected error", exc_info=error)
        yield _sse({"error": {"message": f"internal error: {type(error).__name__}",
                              "type": "server_error", "param": None, "code": 500}})
    yield _sse("[DONE]")


async def bad_request(http: Request, error: BadRequest) -> JSONResponse:
    served(http).metrics.rejected.labels("bad_request").inc()
    return error_response(400, str(error), "invalid_request_error", error.param)


async def http_error(_: Request, error: HTTPException) -> JSONResponse:
    return error_response(error.status_code, str(error.detail), "invalid_request_error")


async def internal_error(_: Request, error: Exception) -> JSONResponse:
    return error_response(500, f"internal error: {type(error).__name__}", "server_error")


@asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    """The scheduler's thread runs while the app does."""
    app.state.served.scheduler.start()
    yield
    app.state.served.scheduler.stop()


def create_app(target: LoadedModel, methods: list[str] | None = None, *, max_batch: int = 16,
               max_queue: int = 64, max_kv_tokens: int | None = None, host: str = "127.0.0.1",
               api_key: str | None = None, cors_origins: list[str] | None = None,
               max_body: int = MAX_BODY_BYTES, options: DraftOptions = DraftOptions()) -> FastAPI:
    """The server for `target`. methods: those requests may choose, the first the default
    (default: `auto`, then plain decoding, `ar`). max_kv_tokens: the KV
    budget (default: from the model and free memory; see scheduler.default_kv_tokens). host: the
    address it will listen on (a loopback one turns the Host check on). api_key: required of
    every request but /health and /metrics. cors_origins: origins browsers may call it from
    (default: none). max_body: the largest request body, in bytes. options: the drafting options
    requests get (their own k and tree override them)."""
    methods = list(dict.fromkeys(methods or [DEFAULT_METHOD, PLAIN]))
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        raise VerispecError(f"unknown method {unknown[0]!r}; choose from {', '.join(METHODS)}")
    if target.tokenizer is None:
        raise VerispecError(f"{target.name} has no tokenizer: the server takes and returns text")
    metrics = Metrics()
    if max_body < 1:
        raise VerispecError(f"the body limit must be >= 1 byte, got {max_body}")
    scheduler = Scheduler(target, metrics, max_batch, max_queue, max_kv_tokens)
    scheduler.prepare(methods, options)

    app = FastAPI(title="verispec", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.served = Served(target, scheduler, metrics, methods, max_batch, max_body, options)
    app.add_middleware(Door, api_key=api_key, check_host=host in LOOPBACK, max_body=max_body)
    if cors_origins:  # outermost: a browser's preflight is answered before the door asks for a key
        app.add_middleware(CORSMiddleware, allow_origins=cors_origins, allow_methods=["GET", "POST"],
                           allow_headers=["Authorization", "Content-Type"])
    app.add_exception_handler(BadRequest, bad_request)
    app.add_exception_handler(HTTPException, http_error)
    app.add_exception_handler(Exception, internal_error)
    app.include_router(routes)
    app.mount("/static", StaticFiles(directory=STATIC), name="static")
    return app


async def _cancel_on_disconnect(http: Request, scheduler: Scheduler, ticket: Ticket) -> None:
    """Wait for the client to disconnect (the body has been read: nothing else arrives), then
    cancel its work and wake its handler (with None)."""
    while (await http.receive())["type"] != "http.disconnect":
        pass
    scheduler.cancel(ticket)
    ticket.events.put_nowait(None)


def _gone_or_failed(event: Failed | None) -> JSONResponse:
    """The answer when a request ends early: its client went away (None), or the engine failed."""
    if event is None:
        return error_response(499, "the client went away", "server_error")  # nobody reads it
    return error_response(event.status, event.message, "server_error")


class _DrainingServer(uvicorn.Server):
    """uvicorn, with SIGTERM / SIGINT draining first: new requests get 503 while those in flight
    finish (up to drain_seconds); a second signal exits at once."""

    def __init__(self, config: uvicorn.Config, scheduler: Scheduler, drain_seconds: float) -> None:
        super().__init__(config)
        self.scheduler, self.drain_seconds = scheduler, drain_seconds
        self.draining = False

    def handle_exit(self, sig, frame) -> None:
        if self.draining:
            super().handle_exit(sig, frame)
            return
        self.draining = True
        threading.Thread(target=self._drain, name="verispec-drain", daemon=True).start()

    def _drain(self) -> None:
        self.scheduler.drain(self.drain_seconds)
        self.should_exit = True


def serve(app: FastAPI, host: str = "127.0.0.1", port: int = 8000, drain_seconds: float = 30.0) -> None:
    """Run `app` until SIGTERM / SIGINT, then drain."""
    config = uvicorn.Config(app, host=host, port=port, log_level="info", timeout_graceful_shutdown=5)
    _DrainingServer(config, app.state.served.scheduler, drain_seconds).run()
