"""Load and fault run for `verispec serve`: many clients, mixed requests, random disconnects,
SIGTERM near the end. Checks that no request gets a 5xx, none is lost without an answer or an
error, every completed greedy answer equals the answer the same prompt gets alone, and reports RSS
before and after, p50/p99 latency and /health's latency under load.

Starts `verispec serve` on a free 127.0.0.1 port with the methods given, then:
1. solo answers: every (prompt, max_tokens) the run uses, alone, greedy, with `ar`;
2. the load: --requests requests from --clients threads (each sends its next request when the
   last ends), drawn with a fixed seed: method, k, tree (tree methods), n, sampling (greedy,
   temperature 1e-40 -- below the greedy floor --, or temperature 0.8 with top_p/top_k),
   streaming or not, prompt (the built-in questions, some repeated into long prompts) and
   max_tokens; --disconnect-share of them hang up at a random point (mid-stream after a random
   number of events, or after a random delay); a prober asks /health every 0.25 s;
3. SIGTERM once the last request has been sent: every request in flight must still finish
   (drain), a request after it must get 503, the server must exit 0.

    python scripts/load_fault.py --requests 1000 --clients 32
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from verispec.bench.questions import load_questions

TREES = ["default", "2x4", "4x16"]


@dataclass
class Plan:
    """One request of the run and what became of it."""

    index: int
    body: dict
    prompt: str
    greedy: bool
    disconnect: bool
    hang_up_after: float  # streaming: events read before hanging up; else seconds
    status: int | None = None
    outcome: str = "unsent"  # completed, error, disconnected, lost
    contents: list[str] = field(default_factory=list)
    seconds: float = 0.0
    detail: str = ""


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def start_server(args: argparse.Namespace, port: int, log: Path) -> subprocess.Popen:
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(root)}
    command = [sys.executable, "-m", "verispec.cli", "serve", "--model", args.model, "--port", str(port),
               "--max-batch", str(args.max_batch), "--max-queue", "4096", "--drain-seconds", "600"]
    for method in args.methods.split(","):
        command += ["--method", method]
    if args.max_kv_tokens:
        command += ["--max-kv-tokens", str(args.max_kv_tokens)]
    process = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=open(log, "w"))
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        try:
            if request(port, "GET", "/health", None, timeout=2)[0] == 200:
                return process
        except OSError:
            if process.poll() is not None:
                break
        time.sleep(0.5)
    process.kill()
    raise SystemExit(f"the server did not start; see {log}")


def request(port: int, method: str, path: str, body: dict | None, timeout: float = 900) -> tuple[int, bytes]:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        connection.request(method, path, None if body is None else json.dumps(body),
                           {"Content-Type": "application/json"})
        response = connection.getresponse()
        return response.status, response.read()
    finally:
        connection.close()


def make_plans(args: argparse.Namespace, methods: list[str], tree_methods: set[str]) -> list[Plan]:
    rng = random.Random(args.seed)
    questions = [q.prompt for q in load_questions()]
    prompts = questions + [" ".join(questions[i: i + 4]) for i in range(0, len(questions), 4)]  # long ones
    plans = []
    for index in range(args.requests):
        method = rng.choice(methods)
        kind = rng.random()
        greedy = kind < 0.6
        body: dict = {"method": method, "max_tokens": rng.choice(args.max_tokens_choices),
                      "stream": rng.random() < 0.5, "n": rng.choice([1, 1, 1, 2])}
        if kind < 0.45:
            body["temperature"] = 0
        elif kind < 0.6:
            body["temperature"] = 1e-40  # below the greedy floor: greedy
        else:
            body |= {"temperature": 0.8, "top_p": rng.choice([0.5, 0.95, 1.0]), "top_k": rng.choice([0, 20]),
                     "seed": rng.randrange(2**64)}
        if method != "ar" and rng.random() < 0.5:
            body["k"] = rng.randint(1, 8)
        if method in tree_methods and rng.random() < 0.4:
            body["tree"] = rng.choice(TREES)
        prompt = rng.choice(prompts)
        body["messages"] = [{"role": "user", "content": prompt}]
        disconnect = rng.random() < args.disconnect_share
        hang_up_after = rng.randint(1, 6) if body["stream"] else rng.uniform(0.0, 3.0)
        plans.append(Plan(index, body, prompt, greedy, disconnect, hang_up_after))
    return plans


def send(port: int, plan: Plan) -> None:
    """Send one planned request and record its outcome."""
    started = time.perf_counter()
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=900)
    try:
        connection.request("POST", "/v1/chat/completions", json.dumps(plan.body),
                           {"Content-Type": "application/json"})
        if plan.disconnect and not plan.body["stream"]:
            time.sleep(plan.hang_up_after)  # hang up before (or after) the answer is ready
            connection.sock.shutdown(socket.SHUT_RDWR)
            plan.outcome = "disconnected"
            return
        response = connection.getresponse()
        plan.status = response.status
        if response.status != 200:
            plan.outcome, plan.detail = "error", response.read().decode()[:200]
            return
        if not plan.body["stream"]:
            reply = json.loads(response.read())
            choices = sorted(reply["choices"], key=lambda c: c["index"])
            plan.contents = [c["message"]["content"] for c in choices]
            plan.outcome = "completed"
            return
        texts = [""] * plan.body["n"]
        events = 0
        while True:
            line = response.readline()
            if not line:
                plan.outcome, plan.detail = "lost", "the stream ended without [DONE]"
                return
            if not line.startswith(b"data: "):
                continue
            data = line[6:].strip()
            if data == b"[DONE]":
                break
            event = json.loads(data)
            if "error" in event:
                plan.outcome, plan.status = "error", event["error"]["code"]
                plan.detail = event["error"]["message"]
                response.read()
                return
            for choice in event["choices"]:
                texts[choice["index"]] += choice["delta"].get("content") or ""
            events += 1
            if plan.disconnect and events >= plan.hang_up_after:
                connection.sock.shutdown(socket.SHUT_RDWR)
                plan.outcome = "disconnected"
                return
        plan.contents, plan.outcome = texts, "completed"
    except (OSError, http.client.HTTPException, ValueError) as error:
        plan.outcome, plan.detail = "lost", f"{type(error).__name__}: {error}"
    finally:
        plan.seconds = time.perf_counter() - started
        connection.close()


def percentile(values: list[float], q: int) -> float:
    if len(values) < 2:
        return values[0] if values else float("nan")
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--methods", default="self-int4-pld,pld,ar,lookahead,eagle,medusa",
                        help="comma-separated methods the server serves (and requests mix)")
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--max-batch", type=int, default=16)
    parser.add_argument("--max-kv-tokens", type=int, default=None)
    parser.add_argument("--max-tokens-choices", type=lambda t: [int(x) for x in t.split(",")],
                        default=[8, 16, 32], help="comma-separated max_tokens values drawn from")
    parser.add_argument("--disconnect-share", type=float, default=1 / 3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log", type=Path, default=Path("runs/load_fault_server.log"))
    args = parser.parse_args()
    args.log.parent.mkdir(parents=True, exist_ok=True)
    from verispec.methods import TREE_METHODS

    methods = args.methods.split(",")
    plans = make_plans(args, methods, set(TREE_METHODS))
    port = free_port()
    process = start_server(args, port, args.log)
    server = psutil.Process(process.pid)
    try:
        # 1. Solo answers (and warm-up: first forwards, caches, allocator).
        solo: dict[tuple[str, int], str] = {}
        for plan in plans:
            key = (plan.prompt, plan.body["max_tokens"])
            if plan.greedy and key not in solo:
                status, raw = request(port, "POST", "/v1/chat/completions", {
                    "messages": plan.body["messages"], "max_tokens": key[1], "temperature": 0,
                    "method": "ar"})
                assert status == 200, raw
                solo[key] = json.loads(raw)["choices"][0]["message"]["content"]
        print(f"solo answers: {len(solo)}", file=sys.stderr, flush=True)
        rss_before = server.memory_info().rss

        # 2. The load, with a /health prober and an RSS sampler.
        health: list[float] = []
        rss_peak = [rss_before]
        stop = threading.Event()

        def probe() -> None:
            while not stop.is_set():
                started = time.perf_counter()
                try:
                    request(port, "GET", "/health", None, timeout=30)
                    health.append(time.perf_counter() - started)
                    rss_peak[0] = max(rss_peak[0], server.memory_info().rss)
                except (OSError, psutil.Error):
                    pass
                stop.wait(0.25)

        pending = list(reversed(plans))
        lock = threading.Lock()
        all_sent = threading.Event()
        rss_by_ended: list[tuple[int, float]] = []  # (requests ended, server RSS MiB), every 100
        ended = [0]

        def client() -> None:
            while True:
                with lock:
                    if not pending:
                        all_sent.set()
                        return
                    plan = pending.pop()
                send(port, plan)
                with lock:
                    ended[0] += 1
                    if ended[0] % 100 == 0:
                        rss_by_ended.append((ended[0], round(server.memory_info().rss / 2**20, 1)))
                        print(f"ended: {ended[0]}", file=sys.stderr, flush=True)

        started = time.perf_counter()
        prober = threading.Thread(target=probe, daemon=True)
        prober.start()
        threads = [threading.Thread(target=client) for _ in range(args.clients)]
        for thread in threads:
            thread.start()
        all_sent.wait()
        # 3. SIGTERM near the end: the last requests are in flight or queued.
        time.sleep(0.5)
        rss_after = server.memory_info().rss
        process.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        try:
            after_term = request(port, "POST", "/v1/chat/completions", {
                "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}, timeout=30)[0]
        except OSError:
            after_term = None
        for thread in threads:
            thread.join()
        seconds = time.perf_counter() - started
        stop.set()
        exit_code = process.wait(timeout=600)
    finally:
        if process.poll() is None:
            process.kill()

    completed = [p for p in plans if p.outcome == "completed"]
    errors = [p for p in plans if p.outcome == "error"]
    lost = [p for p in plans if p.outcome in ("lost", "unsent")]
    five = [p for p in plans if p.status is not None and p.status >= 500]
    greedy = [p for p in completed if p.greedy]
    unequal = [p for p in greedy if any(c != solo[(p.prompt, p.body["max_tokens"])] for c in p.contents)]
    latencies = [p.seconds for p in completed]
    by_method = {m: sum(1 for p in completed if p.body["method"] == m) for m in methods}
    report = {
        "requests": len(plans), "clients": args.clients, "seconds": round(seconds, 1),
        "completed": len(completed), "disconnected": sum(p.outcome == "disconnected" for p in plans),
        "errors": len(errors), "lost": len(lost), "5xx": len(five),
        "greedy_completed": len(greedy), "greedy_unequal_to_solo": len(unequal),
        "completed_by_method": by_method,
        "latency_p50_s": round(percentile(latencies, 50), 2),
        "latency_p99_s": round(percentile(latencies, 99), 2),
        "health_p50_ms": round(1000 * percentile(health, 50), 1),
        "health_p99_ms": round(1000 * percentile(health, 99), 1),
        "health_max_ms": round(1000 * max(health, default=float("nan")), 1), "health_probes": len(health),
        "rss_before_mib": round(rss_before / 2**20, 1), "rss_after_mib": round(rss_after / 2**20, 1),
        "rss_peak_mib": round(rss_peak[0] / 2**20, 1), "rss_mib_by_requests_ended": rss_by_ended,
        "status_after_sigterm": after_term, "server_exit_code": exit_code,
    }
    print(json.dumps(report, indent=1))
    for plan in (errors + lost + unequal)[:10]:
        print(f"request {plan.index} ({plan.outcome}, {plan.status}): {plan.body['method']} "
              f"k={plan.body.get('k')} tree={plan.body.get('tree')} n={plan.body['n']}: {plan.detail}",
              file=sys.stderr)
    ok = not five and not lost and not unequal and after_term == 503 and exit_code == 0
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
