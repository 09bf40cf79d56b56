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
from collections import deque
from dataclasses import dataclass, field

from verispec.drafters.prediction import PredictionDrafter
from verispec.engine import Speculation
from verispec.errors import VerispecError
from verispec.methods import PLAIN, build_engine, build_speculation
from verispec.models import LoadedModel
from verispec.options import DraftOptions
from verispec.server.metrics import Metrics
from verispec.stopping import StoppingRules
from verispec.types import SamplingParams, Step

log = logging.getLogger("verispec.server")
# Ways of speculating (method, k, tree) one server builds at most: each keeps its drafters and the
# engine keeps a pool of caches for each, so clients must not be able to make them without end.
MAX_SPECULATIONS = 32


class QueueFull(Exception):
    """The waiting queue is at --max-queue: the client should retry later (429)."""


class ShuttingDown(Exception):
    """The server is draining before it exits: no new requests (503)."""


@dataclass(frozen=True)
class GenerationRequest:
    """A validated generation request: n sequences of one prompt."""

    prompt_ids: list[int]
    stopping: StoppingRules
    sampling: SamplingParams
    seed: int | None
    n: int
    method: str
    options: DraftOptions  # k and tree; the rest are the method's defaults
    prediction: list[int] | None = None  # the predicted output's ids (OpenAI's `prediction`)


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


Event = Admitted | Refused | Stepped | Failed


@dataclass(eq=False)
class Ticket:
    """One request's link between the worker and its handler."""

    request: GenerationRequest
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    submitted: float = field(default_factory=time.perf_counter)
    cancelled: bool = False
    # Worker-side bookkeeping.
    unfinished: int = 0
    first_token_seen: bool = False

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
                 max_queue: int = 64) -> None:
        if max_batch < 1 or max_queue < 0:
            raise VerispecError(f"max_batch must be >= 1 and max_queue >= 0, got {max_batch}, {max_queue}")
        self.target, self.metrics = target, metrics
        self.max_batch, self.max_queue = max_batch, max_queue
        self._engine = build_engine(target, PLAIN)
        self._speculations: dict[tuple[str, int | None, object], Speculation] = {}
        self._waiting: deque[Ticket] = deque()
        self._rows: dict[int, tuple[Ticket, int, int]] = {}  # row id -> ticket, index, tokens so far
        self._accepting = True
        self._stopping = False
        self._idle = True
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="verispec-scheduler", daemon=True)

    # -- the handlers' side ----------------------------------------------------------------------

    def prepare(self, methods: list[str]) -> None:
        """Build each method's speculation (default settings) now: the first requests do not
        wait for it, and a method the model cannot run fails before the server starts."""
        for method in methods:
            self.speculation(method, DraftOptions())

    def start(self) -> None:
        """Start stepping (on the worker thread)."""
        self._thread.start()

    def check_prompt(self, prompt_ids: list[int], max_new_tokens: int) -> None:
        """The engine's prompt checks (they read only the model's fixed sizes: thread-safe)."""
        self._engine.check_prompt(prompt_ids, max_new_tokens)

    def submit(self, request: GenerationRequest) -> Ticket:
        """Queue a request; its events arrive on the returned ticket."""
        ticket = Ticket(request, asyncio.get_running_loop())
        with self._cond:
            if not self._accepting:
                raise ShuttingDown
            if len(self._waiting) >= self.max_queue:
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
        """False once draining or stopped."""
        return self._accepting

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
        """One Speculation per (method, k, tree), so drafters are built once and reused."""
        key = (method, options.k, options.tree)
        if key not in self._speculations:
            if len(self._speculations) >= MAX_SPECULATIONS:
                raise VerispecError(f"this server already holds {MAX_SPECULATIONS} ways of speculating "
                                    "(method, k, tree); use the method's default k and tree")
            self._speculations[key] = build_speculation(self.target, method, options)
        return self._speculations[key]

    def _run(self) -> None:
        while True:
            with self._cond:
                self._idle = not self._waiting and not self._rows
                if self._idle:
                    self._cond.notify_all()
                self._cond.wait_for(lambda: self._stopping or self._waiting or self._rows)
                if self._stopping:
                    break
                admitted = []
                while self._waiting and (self._waiting[0].cancelled or len(self._rows) + sum(
                        t.request.n for t in admitted) + self._waiting[0].request.n <= self.max_batch):
                    ticket = self._waiting.popleft()
                    if ticket.cancelled:
                        self.metrics.finished(ticket.submitted, "abort")
                    else:
                        admitted.append(ticket)
                self.metrics.waiting.set(len(self._waiting))
            self._drop_cancelled()
            for ticket in admitted:
                self._admit(ticket)
            self.metrics.running.set(len(self._rows))
            if self._rows:
                self._step()
                self.metrics.running.set(len(self._rows))
        for ticket in {ticket for ticket, _, _ in self._rows.values()} | set(self._waiting):
            ticket.post(Failed("the server is shutting down"))

    def _drop_cancelled(self) -> None:
        for row_id, (ticket, _, _) in list(self._rows.items()):
            if ticket.cancelled:
                self._engine.cancel(row_id)
                del self._rows[row_id]
                ticket.unfinished -= 1
                if ticket.unfinished == 0:
                    self.metrics.finished(ticket.submitted, "abort")

    def _admit(self, ticket: Ticket) -> None:
        request = ticket.request
        try:
            speculation = self.speculation(request.method, request.options)
            row_ids = self._engine.add(request.prompt_ids, request.stopping, request.sampling,
                                       request.seed, samples=request.n, speculation=speculation,
                                       prediction=None if request.prediction is None
                                       else PredictionDrafter(request.prediction))
        except VerispecError as error:  # counted as a bad request by the handler
            ticket.post(Refused(str(error)))
            return
        except Exception as error:  # a bug: log it, fail only this request
            self.metrics.rejected.labels("internal_error").inc()
            ticket.post(Failed(f"internal error: {type(error).__name__}"))
            log.error("scheduler: unexpected error", exc_info=error)
            return
        for index, row_id in enumerate(row_ids):
            self._rows[row_id] = (ticket, index, 0)
        ticket.unfinished = len(row_ids)
        self.metrics.prompt_tokens.inc(len(request.prompt_ids) * request.n)
        ticket.post(Admitted())

    def _step(self) -> None:
        try:
            results = self._engine.step()
        except Exception as error:  # the engine has dropped every row: fail their requests
            for ticket in {ticket for ticket, _, _ in self._rows.values()}:
                self.metrics.rejected.labels("internal_error").inc()
                ticket.post(Failed(f"internal error: {type(error).__name__}"))
            self._rows.clear()
            log.error("scheduler: unexpected error", exc_info=error)
            return
        for row_id, step in results:
            ticket, index, produced = self._rows[row_id]
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
                ticket.unfinished -= 1
                if ticket.unfinished == 0:
                    self.metrics.finished(ticket.submitted, reason)
            ticket.post(Stepped(index, step, reason))
