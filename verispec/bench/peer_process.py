"""External peers (llama.cpp, Hugging Face generate()) in a child process each, so that a peer
that crashes (llama.cpp's native build dies with SIGILL on a VM that grants no AMX tile state)
takes its own row down and nothing else.

The parent sends a question's prompt ids and waits; the child runs the peer exactly as the bench
ran it in process (its own clock around the prompt's prefill and decoding, its own peak memory)
and sends the Outcome back. The child idles while the parent times verispec's rows, so the rows
run interleaved one at a time as before. Children are forked from a fork server that has
imported verispec and torch but never computed (a fork of a process whose OpenMP pool has run
can hang, and a child must not inherit the parent's models); where there is none, spawned.
"""

from __future__ import annotations

import multiprocessing
import signal
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection

import torch

from verispec.bench.contender import Outcome
from verispec.bench.machine import PeakResident
from verispec.core.errors import VerispecError

# What a child runs: start(**arguments) -> a function prompt ids -> Outcome. Both picklable:
# `start` a module-level function, `arguments` plain values (paths, ids, configs).
Start = Callable[..., Callable[[list[int]], Outcome]]


@dataclass(frozen=True)
class Job:
    start: Start
    arguments: dict = field(default_factory=dict)


class PeerCrashed(Exception):
    """A peer's child process died (a signal, an exit) or its run raised: `why` says which,
    e.g. "SIGILL", "exit 3", "RuntimeError: ..."."""

    def __init__(self, label: str, why: str):
        super().__init__(f"{label} crashed ({why})")
        self.label, self.why = label, why


def death(exitcode: int | None) -> str:
    """How a child process ended, from its exit code: a signal's name ("SIGILL") or "exit N"."""
    if exitcode is not None and exitcode < 0:
        try:
            return signal.Signals(-exitcode).name
        except ValueError:
            return f"signal {-exitcode}"
    return f"exit {exitcode}"


# What the fork server imports once for all the children it forks: the baselines, and the parts of
# transformers a Hugging Face peer's loading and generate() import (transformers imports lazily:
# without these a child spent ~6 of its ~8 s of start on imports, on the AVX2 EPYC).
PRELOAD = ["verispec.bench.baselines", "transformers.modeling_utils", "transformers.generation.utils",
           "transformers.models.auto.modeling_auto", "transformers.models.auto.tokenization_auto"]


def process_context() -> multiprocessing.context.BaseContext:
    """The fork server with the peers' imports done once (a child starts in about a second
    instead of importing torch and transformers anew); spawn where there is none."""
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("spawn")
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(PRELOAD)
    return context


def _serve(connection: Connection, job: Job, threads: int) -> None:
    """The child: build the peer, say "ready" (or the VerispecError that refused it), then answer
    each prompt with its Outcome until the parent closes the pipe."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's: it stops the bench
    torch.set_num_threads(threads)
    try:
        generate = job.start(**job.arguments)
    except VerispecError as error:
        connection.send(("refused", str(error)))
        return
    connection.send(("ready", None))
    while True:
        try:
            prompt_ids = connection.recv()
        except EOFError:
            return
        try:
            with PeakResident() as memory:
                outcome = generate(prompt_ids)
        except Exception as error:  # noqa: BLE001 - reported to the parent as this row's crash
            traceback.print_exc()
            connection.send(("failed", f"{type(error).__name__}: {error}"))
            return
        outcome.peak_rss_mib = memory.peak
        connection.send(("outcome", outcome))


class PeerProcess:
    """One peer in its own child process, with `threads` compute threads. Started at once (a
    peer that refuses the target raises VerispecError here, before anything is timed);
    `generate` raises PeerCrashed once the child has died, then and on every later call."""

    def __init__(self, label: str, job: Job, threads: int):
        self.label = label
        context = process_context()
        self._connection, child = context.Pipe()
        self._process = context.Process(target=_serve, args=(child, job, threads), daemon=True,
                                        name=f"verispec peer {label}")
        self._process.start()
        child.close()  # the child's end lives in the child: its death closes the pipe
        self._crash: str | None = None
        kind, detail = self._receive()
        if kind == "refused":
            self.close()
            raise VerispecError(detail)

    def _receive(self) -> tuple[str, object]:
        """The child's next message; ("crashed", why) once it has died or failed."""
        if self._crash is None:
            try:
                kind, detail = self._connection.recv()
            except (EOFError, ConnectionResetError):
                self._process.join()
                self._crash = death(self._process.exitcode)
            else:
                if kind == "failed":
                    self._process.join()
                    self._crash = str(detail)
                else:
                    return kind, detail
        return "crashed", self._crash

    def generate(self, prompt_ids: list[int]) -> Outcome:
        if self._crash is None:
            try:
                self._connection.send(prompt_ids)
            except (BrokenPipeError, ConnectionResetError):
                pass  # the child is gone: _receive says how it ended
        kind, detail = self._receive()
        if kind == "crashed":
            raise PeerCrashed(self.label, str(detail))
        return detail

    def close(self) -> None:
        """End the child (closing the pipe ends its loop) and reap it."""
        self._connection.close()
        self._process.join(timeout=10)
        if self._process.is_alive():
            self._process.kill()
            self._process.join()
