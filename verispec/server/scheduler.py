"""The one thread that drives the batched engine for the server.

The engine is not thread-safe, so a single worker owns it: between steps it admits waiting
requests into the batch (while the batch has room), drops the rows of requests whose clients went
away, then steps every row with one shared target pass and hands each row's Step to its request's
asyncio queue (loop.call_soon_threadsafe). HTTP handlers only submit, cancel and read events.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field, replace

import psutil

from verispec.core.errors import VerispecError
from verispec.core.stopping import StoppingRules
from verispec.core.tree import TreeSettings
from verispec.core.types import Step
from verispec.decoding.engine import RowFailure
from verispec.decoding.sequence import Speculation
from verispec.methods import METHODS, PLAIN, build_engine, resolve, speculation_for_checked
from verispec.model.loading import LoadedModel, context_length
from verispec.options import DraftOptions
from verispec.request import Request
from verispec.server.metrics import Metrics

log = logging.getLogger("verispec.server")
# A way of speculating: (method, k, model_k, tree).
Way = tuple[str, int | None, int | None, TreeSettings | None]
# Ways of speculating one server holds at most: each keeps a pool of drafters, so past this the
# least recently used one that no sequence uses is dropped (the methods the server was started
# with stay).
MAX_SPECULATIONS = 32
# Idle drafters kept for a way of speculating a client chose (the --method defaults keep as many as
# ran at once, up to --max-batch): more are built again when needed.
IDLE_PER_CHOSEN = 1
# KV room a sequence reserves beyond its prompt and max_tokens: the block a step feeds (the last
# token, a draft of k <= 64 tokens or a tree of <= 64 nodes, a lookahead side branch) sits in the
# cache until verification rewinds it.
BLOCK_ROOM = 160
# Share of the memory available at start-up that the default KV budget may use.
DEFAULT_KV_SHARE = 0.25


class QueueFull(Exception):
    """The waiting queue is at --max-queue: the client should retry later (429)."""


class ShuttingDown(Exception):
    """The server is draining before it exits, or its engine thread has died: no new requests
    (503)."""


def kv_bytes_per_token(target: LoadedModel) -> int:
    """Bytes of keys and values one cached token takes in the target (every layer)."""
    config = target.model.config.get_text_config(decoder=True)
    heads = int(config.num_attention_heads)
    kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // heads)
    return 2 * int(config.num_hidden_layers) * kv_heads * head_dim * target.model.dtype.itemsize


def default_kv_tokens(target: LoadedModel, max_batch: int) -> int:
    """The KV budget when none is given: DEFAULT_KV_SHARE of the memory available now, counting
    each token twice (a cache's buffer doubles when it fills, and a self or model drafter keeps a
    cache of its own), and no more than max_batch full contexts."""
    per_token = 2 * 2 * kv_bytes_per_token(target)
    available = int(psutil.virtual_memory().available * DEFAULT_KV_SHARE) // per_token
    return max(1, min(available, max_batch * (context_length(target.model) + BLOCK_ROOM)))



def kv_tokens(request: Request) -> int:
    """The KV cache tokens a request's sequences (one prompt, n sequences) may hold at most."""
    return request.sequences * (len(request.prompts[0]) + request.stopping.max_new_tokens + BLOCK_ROOM)


# Events a ticket receives, in order: Admitted or Refused; then Stepped until every sequence has
# finished; Failed at any point if the engine broke (the request is over).
@dataclass(frozen=True)
class Admitted:
    pass


@dataclass(frozen=True)
class Refused:
    message: str  # why engine.add refused the request (a bad request: 400)


@dataclass(frozen=True)
class Stepped:
    index: int  # which of the request's n sequences
    step: Step
    finish_reason: str | None  # "stop" or "length" once this sequence has finished


@dataclass(frozen=True)
class Failed:
    message: str  # an internal error (500); the traceback stays in the server's log
    status: int = 500  # 503: the server is shutting down or its engine thread died


Event = Admitted | Refused | Stepped | Failed


@dataclass(eq=False)
class Ticket:
    """One request's link between the worker and its handler."""

    request: Request
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    submitted: float = field(default_factory=time.perf_counter)
    cancelled: bool = False
    # Worker-side bookkeeping.
    unfinished: int = 0
    first_token_seen: bool = False
    failed: bool = False

    def post(self, event: Event) -> None:
        try:
            self.loop.call_soon_threadsafe(self.events.put_nowait, event)
        except RuntimeError:  # the event loop has closed: nobody is listening any more
            pass


def finish_reason(step: Step, produced: int, stopping: StoppingRules) -> str | None:
    """OpenAI's finish_reason for a sequence after `step` (`produced` tokens in all so far)."""
    if not step.finished:
        return None
    if step.tokens and step.tokens[-1] in stopping.eos_token_ids:
        return "stop"
    return "length" if produced >= stopping.max_new_tokens else "stop"


class Scheduler:
    """Admits requests into the running batch and steps it, on its own thread."""

    def __init__(self, target: LoadedModel, metrics: Metrics, max_batch: int = 16,
                 max_queue: int = 64, max_kv_tokens: int | None = None) -> None:
        """max_queue: requests that may wait for room (a request that can start at once never
        waits). max_kv_tokens: the KV budget, in cached tokens over all running sequences
        (default: default_kv_tokens)."""
        if max_batch < 1 or max_queue < 0:
            raise VerispecError(f"max_batch must be >= 1 and max_queue >= 0, got {max_batch}, {max_queue}")
        if max_kv_tokens is not None and max_kv_tokens < 1:
            raise VerispecError(f"max_kv_tokens must be >= 1, got {max_kv_tokens}")
        self.target, self.metrics = target, metrics
        self.max_batch, self.max_queue = max_batch, max_queue
        self.max_kv_tokens = max_kv_tokens or default_kv_tokens(target, max_batch)
        self._engine = build_engine(target, PLAIN)
        # Least recently used first; those the server was started with are pinned.
        self._speculations: OrderedDict[Way, Speculation] = OrderedDict()
        self._pinned: set[Way] = set()
        self._waiting: deque[Ticket] = deque()
        self._rows: dict[int, tuple[Ticket, int, int]] = {}  # row id -> ticket, index, tokens so far
        self._sequences = 0  # sequences running (under the lock: submit reads it)
        self._reserved = 0  # KV tokens the running requests reserve (under the lock)
        self._accepting = True
        self._stopping = False
        self._idle = True
        self.died: BaseException | None = None  # what ended the worker thread, if it died
        self._admitting: list[Ticket] = []  # taken from the queue, not yet in the batch
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="verispec-scheduler", daemon=True)

    # -- the handlers' side ----------------------------------------------------------------------

    def prepare(self, methods: list[str], options: DraftOptions = DraftOptions()) -> None:
        """Build each method's speculation (the server's options) now: the first requests do not
        wait for it, and a method the model cannot run fails before the server starts."""
        for method in methods:
            tree = options.tree if METHODS[method].trees else None  # --tree: for tree methods
            self.speculation(method, resolve(method, replace(options, tree=tree)))
        self._pinned = set(self._speculations)

    def start(self) -> None:
        """Start stepping (on the worker thread)."""
        self._thread.start()

    def check_fits(self, request: Request) -> None:
        """Refuse a request that could never fit the KV budget, even alone."""
        if kv_tokens(request) > self.max_kv_tokens:
            raise VerispecError(
                f"this request needs {kv_tokens(request)} KV cache tokens (n {request.sequences} x (prompt "
                f"{len(request.prompts[0])} + max_tokens {request.stopping.max_new_tokens} + "
                f"{BLOCK_ROOM} for drafts)), more than the server's --max-kv-tokens "
                f"{self.max_kv_tokens}: lower max_tokens or n, or shorten the prompt")

    def _fits(self, request: Request, sequences: int, reserved: int) -> bool:
        return (sequences + request.sequences <= self.max_batch
                and reserved + kv_tokens(request) <= self.max_kv_tokens)

    def submit(self, request: Request) -> Ticket:
        """Queue a request; its events arrive on the returned ticket."""
        ticket = Ticket(request, asyncio.get_running_loop())
        with self._cond:
            if not self._accepting:
                raise ShuttingDown
            starts_now = not self._waiting and self._fits(request, self._sequences, self._reserved)
            if not starts_now and len(self._waiting) >= self.max_queue:
                raise QueueFull
            self._waiting.append(ticket)
            self._idle = False
            self.metrics.waiting.set(len(self._waiting))
            self._cond.notify_all()
        return ticket

    def cancel(self, ticket: Ticket) -> None:
        """The client went away: its rows leave the batch before the next step."""
        with self._cond:
            ticket.cancelled = True
            self._cond.notify_all()

    @property
    def accepting(self) -> bool:
        """False once draining or stopped, or once the worker thread has died."""
        return self._accepting

    @property
    def reserved_kv_tokens(self) -> int:
        """KV tokens the running requests reserve now."""
        return self._reserved

    @property
    def running(self) -> int:
        """Sequences in the batch now."""
        return len(self._rows)

    def drain(self, seconds: float) -> bool:
        """Refuse new requests, wait up to `seconds` for those queued or running to finish;
        whether they all did."""
        with self._cond:
            self._accepting = False
            return self._cond.wait_for(lambda: self._idle, timeout=seconds)

    def stop(self) -> None:
        """End the worker; requests still running get Failed."""
        with self._cond:
            self._accepting = False
            self._stopping = True
            self._cond.notify_all()
        if self._thread.is_alive():
            self._thread.join()

    # -- the worker ------------------------------------------------------------------------------

    def speculation(self, method: str, options: DraftOptions) -> Speculation:
        """The Speculation of (method, options) with options `resolve` has checked: one per
        (method, k, model_k, tree), so drafters are built once and reused; past
        MAX_SPECULATIONS the least recently used one no sequence uses is dropped with its pool."""
        key = (method, options.k, options.model_k, options.tree)
        if key in self._speculations:
            self._speculations.move_to_end(key)
            return self._speculations[key]
        if len(self._speculations) >= MAX_SPECULATIONS:
            unused = next((k for k, how in self._speculations.items()
                           if k not in self._pinned and self._engine.forget(how)), None)
            if unused is None:
                raise VerispecError(f"this server holds {MAX_SPECULATIONS} ways of speculating "
                                    "(method, k, model_k, tree), all in use; use the method's defaults")
            del self._speculations[unused]
        self._speculations[key] = how = speculation_for_checked(self.target, method, options)
        if self._pinned:  # one a client chose (not a --method default): keep one idle drafter
            self._engine.pool_limit[how] = IDLE_PER_CHOSEN
        return how

    def _run(self) -> None:
        """The worker: step until stopped; if it dies, every request fails at once (503)."""
        try:
            self._loop()
        except BaseException as error:
            self.died = error
            log.critical("scheduler: the engine thread died", exc_info=error)
        with self._cond:
            self._accepting = False
            self._idle = True
            self._cond.notify_all()
            tickets = ({ticket for ticket, _, _ in self._rows.values()} | set(self._waiting)
                       | set(self._admitting))
            self._waiting.clear()
        message = ("the server is shutting down" if self.died is None
                   else f"the server's engine thread died ({type(self.died).__name__})")
        for ticket in tickets:
            ticket.post(Failed(message, 503))

    def _loop(self) -> None:
        while True:
            with self._cond:
                self._idle = not self._waiting and not self._rows
                if self._idle:
                    self._cond.notify_all()
                self._cond.wait_for(lambda: self._stopping or self._waiting or self._rows)
                if self._stopping:
                    return
                admitted = self._admitting = []
                while self._waiting and (self._waiting[0].cancelled or self._fits(
                        self._waiting[0].request, self._sequences, self._reserved)):
                    ticket = self._waiting.popleft()
                    if ticket.cancelled:
                        self.metrics.finished(ticket.submitted, "abort")
                    else:  # its room is taken now; _admit gives it back if the engine refuses
                        admitted.append(ticket)
                        self._sequences += ticket.request.sequences
                        self._reserved += kv_tokens(ticket.request)
                self.metrics.waiting.set(len(self._waiting))
            self._drop_cancelled()
            for ticket in admitted:
                self._admit(ticket)
            self._admitting = []
            self.metrics.running.set(len(self._rows))
            if self._rows:
                self._step()
                self.metrics.running.set(len(self._rows))

    def _release(self, ticket: Ticket, sequences: int) -> None:
        """`sequences` of the ticket's have left the batch; the last gives back its KV room."""
        ticket.unfinished -= sequences
        with self._cond:
            self._sequences -= sequences
            if ticket.unfinished == 0:
                self._reserved -= kv_tokens(ticket.request)
            self._cond.notify_all()

    def _drop_cancelled(self) -> None:
        for row_id, (ticket, _, _) in list(self._rows.items()):
            if ticket.cancelled:
                self._engine.cancel(row_id)
                del self._rows[row_id]
                self._release(ticket, 1)
                if ticket.unfinished == 0 and not ticket.failed:
                    self.metrics.finished(ticket.submitted, "abort")

    def _admit(self, ticket: Ticket) -> None:
        request = ticket.request
        ticket.unfinished = request.sequences
        try:
            speculation = self.speculation(request.method, request.options)
            (spec,) = request.specs()
            row_ids = self._engine.add(spec, request.sequences, speculation)
        except VerispecError as error:  # counted as a bad request by the handler
            self._release(ticket, request.sequences)
            ticket.post(Refused(str(error)))
            return
        except Exception as error:  # a bug: log it, fail only this request
            self._release(ticket, request.sequences)
            self.metrics.rejected.labels("internal_error").inc()
            ticket.post(Failed(f"internal error: {type(error).__name__}"))
            log.error("scheduler: unexpected error", exc_info=error)
            return
        for index, row_id in enumerate(row_ids):
            self._rows[row_id] = (ticket, index, 0)
        self.metrics.prompt_tokens.inc(len(request.prompts[0]) * request.sequences)
        ticket.post(Admitted())

    def _fail(self, ticket: Ticket, error: BaseException) -> None:
        """Fail one request (its other sequences leave the batch before the next step)."""
        if not ticket.failed:
            ticket.failed = ticket.cancelled = True
            self.metrics.rejected.labels("internal_error").inc()
            ticket.post(Failed(f"internal error: {type(error).__name__}"))
            log.error("scheduler: a request failed in a step", exc_info=error)

    def _step(self) -> None:
        try:
            results = self._engine.step()
        except Exception as error:  # the shared pass failed: the engine has dropped every row
            for row_id, (ticket, _, _) in list(self._rows.items()):
                self._fail(ticket, error)
                del self._rows[row_id]
                self._release(ticket, 1)
            return
        for row_id, step in results:
            ticket, index, produced = self._rows[row_id]
            if isinstance(step, RowFailure):  # only this row failed; the others' steps stand
                self._fail(ticket, step.error)
                del self._rows[row_id]
                self._release(ticket, 1)
                continue
            if ticket.failed:  # a sibling sequence failed: this one leaves at the next step
                continue
            produced += len(step.tokens)
            reason = finish_reason(step, produced, ticket.request.stopping)
            if not ticket.first_token_seen and step.tokens:
                ticket.first_token_seen = True
                self.metrics.time_to_first_token.observe(time.perf_counter() - ticket.submitted)
            self.metrics.stepped(ticket.request.method, step)
            if reason is None:
                self._rows[row_id] = (ticket, index, produced)
            else:  # gone from the batch before its client hears the last step
                del self._rows[row_id]
                self._release(ticket, 1)
                if ticket.unfinished == 0:
                    self.metrics.finished(ticket.submitted, reason)
            ticket.post(Stepped(index, step, reason))
