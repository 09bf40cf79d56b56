"""Load test for `verispec serve`: requests/s and p50/p99 latency at several numbers of concurrent
clients, with speculation on (the server's fastest method) and off (`ar`).

Starts `verispec serve` on a free 127.0.0.1 port (or uses --url), sends non-streaming greedy chat
requests of the built-in prompts (verispec/bench/prompts.jsonl, in turn) from N client threads,
each sending its next request when the last is answered, and prints a markdown table.

    python scripts/load_test.py --max-tokens 64 --concurrency 1,4,16
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from verispec.bench.questions import load_questions


def post(url: str, body: dict, timeout: float = 600) -> dict:
    request = urllib.request.Request(url + "/v1/chat/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.loads(response.read())


def start_server(model: str, max_batch: int) -> tuple[subprocess.Popen, str]:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": str(root)}
    process = subprocess.Popen([sys.executable, "-m", "verispec.cli", "serve", "--model", model,
                                "--port", str(port), "--max-batch", str(max_batch)],
                               env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        try:
            urllib.request.urlopen(url + "/health", timeout=2)
            return process, url
        except OSError:
            if process.poll() is not None:
                break
            time.sleep(0.5)
    process.kill()
    raise SystemExit("the server did not start")


def run_level(url: str, method: str, clients: int, requests: int, prompts: list[str],
              max_tokens: int) -> dict:
    """`requests` requests from `clients` threads; throughput and latency."""
    latencies: list[float] = []
    tokens = forwards = 0

    def one(i: int) -> None:
        nonlocal tokens, forwards
        started = time.perf_counter()
        reply = post(url, {"messages": [{"role": "user", "content": prompts[i % len(prompts)]}],
                           "temperature": 0, "max_tokens": max_tokens, "method": method})
        latencies.append(time.perf_counter() - started)
        tokens += reply["usage"]["completion_tokens"]
        forwards += reply["verispec"]["target_forwards"]

    started = time.perf_counter()
    with ThreadPoolExecutor(clients) as pool:
        list(pool.map(one, range(requests)))
    seconds = time.perf_counter() - started
    cuts = statistics.quantiles(latencies, n=100, method="inclusive")
    return {"method": method, "clients": clients, "requests": requests,
            "rps": requests / seconds, "p50": statistics.median(latencies), "p99": cuts[98],
            "tok_s": tokens / seconds, "tau": tokens / forwards}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--url", help="an already running server (default: start one)")
    parser.add_argument("--methods", default=None,
                        help="comma-separated (default: the server's default method, then ar)")
    parser.add_argument("--concurrency", default="1,4,16")
    parser.add_argument("--requests-per-client", type=int, default=2,
                        help="requests per level: this many per client, at least 4")
    parser.add_argument("--max-tokens", type=int, default=64)
    args = parser.parse_args()
    levels = [int(c) for c in args.concurrency.split(",")]
    process = None
    url = args.url
    if url is None:
        process, url = start_server(args.model, max(levels))
    try:
        with urllib.request.urlopen(url + "/v1/models") as response:
            served = json.loads(response.read())["data"][0]["verispec"]["methods"]
        methods = args.methods.split(",") if args.methods else served
        prompts = [q.prompt for q in load_questions()]
        for method in methods:  # warm-up: first forwards, drafter caches
            post(url, {"messages": [{"role": "user", "content": prompts[0]}], "max_tokens": 8,
                       "temperature": 0, "method": method})
        rows = []
        for clients in levels:
            for method in methods:
                rows.append(run_level(url, method, clients, max(4, clients * args.requests_per_client),
                                      prompts, args.max_tokens))
                print(f"measured: {rows[-1]}", file=sys.stderr, flush=True)
    finally:
        if process is not None:
            process.terminate()
            process.wait(timeout=60)
    print("| clients | method | requests | requests/s | p50 latency s | p99 latency s | tokens/s | τ |")
    print("| ---: | :--- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        print(f"| {r['clients']} | {r['method']} | {r['requests']} | {r['rps']:.2f} | {r['p50']:.2f} | "
              f"{r['p99']:.2f} | {r['tok_s']:.1f} | {r['tau']:.2f} |")


if __name__ == "__main__":
    main()
