"""A live verispec server for tests: uvicorn in a thread on a free 127.0.0.1 port, bounded in time."""

from __future__ import annotations

import json
import socket
import threading
import time
import urllib.error
import urllib.request

import uvicorn
from fastapi import FastAPI

from verispec.server.scheduler import Scheduler

START_SECONDS = 60


def wait_until(condition, seconds: float = 10) -> None:
    """Poll `condition` until it holds; fail after `seconds`."""
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"still not true after {seconds} s")
        time.sleep(0.002)


class LiveServer:
    """`with LiveServer(app) as server:` serves `app` at server.url until the block ends."""

    def __init__(self, app: FastAPI) -> None:
        self.app = app
        self.socket = socket.socket()
        self.socket.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.socket.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.socket]},
                                       daemon=True)

    @property
    def scheduler(self) -> Scheduler:
        return self.app.state.served.scheduler

    def __enter__(self) -> LiveServer:
        self.thread.start()
        deadline = time.monotonic() + START_SECONDS
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the test server did not start")
            time.sleep(0.02)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)
        self.socket.close()

    def request(self, path: str, body: dict | bytes | None = None,
                timeout: float = 60) -> tuple[int, dict[str, str], object]:
        """(status, headers, parsed JSON or text) for a GET (no body) or a POST."""
        data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.url + path, data=data,
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=timeout) as response:
                status, headers, raw = response.status, dict(response.headers), response.read()
        except urllib.error.HTTPError as error:
            status, headers, raw = error.code, dict(error.headers), error.read()
        text = raw.decode()
        try:
            return status, headers, json.loads(text)
        except ValueError:
            return status, headers, text

    def metric(self, name: str) -> float:
        """The sum of a metric's samples named exactly `name` (any labels)."""
        _, _, text = self.request("/metrics")
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.split("{")[0].split(" ")[0] == name)
