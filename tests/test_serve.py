"""`verispec serve`: the real openai client against a live server; answers equal `verispec
generate`'s, concurrent clients never mix, disconnects free their rows, bad requests get 400s,
a full queue 429, SIGTERM drains; the playground in headless Chromium."""

from __future__ import annotations

import http.client
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import pytest
from openai import OpenAI

from tests.serving import LiveServer, wait_until
from verispec.cli import main
from verispec.model.loading import load_model
from verispec.server import create_app

METHODS = ["pld", "ar", "early-exit"]
CHAT = "w10 w11 w12 w10 w11"
CHROMIUM = Path("/usr/bin/chromium")


@pytest.fixture(scope="module")
def loaded(tiny_dir):
    return load_model(str(tiny_dir))


@pytest.fixture(scope="module")
def server(loaded):
    with LiveServer(create_app(loaded, METHODS)) as live:
        yield live


def client(server: LiveServer) -> OpenAI:
    return OpenAI(base_url=server.url + "/v1", api_key="unused", timeout=60, max_retries=0)


def generated(model_dir, prompt: str, method: str, max_tokens: int, raw: bool, capsys) -> str:
    """What `verispec generate --json` says for the prompt (greedy)."""
    code = main(["generate", "--model", str(model_dir), "--method", method, "--prompt", prompt,
                 "--max-new-tokens", str(max_tokens), "--json", *(["--raw"] if raw else [])])
    assert code == 0
    return json.loads(capsys.readouterr().out)["text"]


def stream_chat(openai: OpenAI, prompt: str, **kwargs) -> tuple[str, list]:
    """The streamed answer's text and its chunks."""
    chunks = list(openai.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": prompt}], stream=True, **kwargs))
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices), chunks


@pytest.mark.parametrize("method", ["pld", "ar"])
def test_openai_client_answers_equal_verispec_generate(server, tiny_dir, capsys, method):
    openai = client(server)
    body = {"temperature": 0, "max_tokens": 24, "extra_body": {"method": method}}
    chat = generated(tiny_dir, CHAT, method, 24, raw=False, capsys=capsys)
    reply = openai.chat.completions.create(model="tiny", messages=[{"role": "user", "content": CHAT}],
                                           **body)
    assert reply.choices[0].message.content == chat
    assert reply.choices[0].finish_reason == "length"
    assert reply.usage.completion_tokens == 24
    extra = reply.model_extra["verispec"]
    assert extra["method"] == method and extra["new_tokens"] == 24
    assert extra["mean_accepted_tokens"] == pytest.approx(24 / extra["target_forwards"])
    if method == "pld":
        assert extra["mean_accepted_tokens"] > 1 and extra["acceptance_by_position"]
    streamed, chunks = stream_chat(openai, CHAT, stream_options={"include_usage": True}, **body)
    assert streamed == chat
    assert chunks[-1].usage.completion_tokens == 24
    fates = [f for c in chunks if c.choices for f in c.model_extra["verispec"]["fates"]]
    assert len(fates) == 24 and set(fates) <= {"accepted", "recovered", "bonus"}

    raw = generated(tiny_dir, "w20 w21 w22 w20", method, 16, raw=True, capsys=capsys)
    completion = openai.completions.create(model="tiny", prompt="w20 w21 w22 w20", max_tokens=16,
                                           **{k: v for k, v in body.items() if k != "max_tokens"})
    assert completion.choices[0].text == raw
    pieces = openai.completions.create(model="tiny", prompt="w20 w21 w22 w20", max_tokens=16,
                                       stream=True, temperature=0, extra_body={"method": method})
    assert "".join(c.choices[0].text for c in pieces) == raw


def test_stop_strings_end_the_text_before_them(server):
    openai = client(server)
    full, _ = stream_chat(openai, CHAT, temperature=0, max_tokens=24)
    stop = full.split()[3]
    for stream in (False, True):
        reply = openai.chat.completions.create(model="tiny", messages=[{"role": "user", "content": CHAT}],
                                               temperature=0, max_tokens=24, stop=[stop], stream=stream)
        text = ("".join(c.choices[0].delta.content or "" for c in reply if c.choices) if stream
                else reply.choices[0].message.content)
        assert text == full[: full.index(stop)], stream


def test_text_stream_holds_back_a_possible_stop_string_across_steps():
    from tests.tiny import tiny_tokenizer
    from verispec.core.types import Fate, Step
    from verispec.server.text import TextStream

    def step(*tokens: int) -> Step:
        return Step(tokens=list(tokens), fates=[Fate.BONUS] * len(tokens))

    text = TextStream(tiny_tokenizer(), ("w6 w7",))
    text.push(step(5, 6))
    assert text.content(final=False) == "w5 "  # "w6" may begin the stop string: held
    text.push(step(8))
    assert text.content(final=False) == "w6 w8"  # it did not
    text.push(step(6))
    text.push(step(7, 9))
    assert text.content(final=True) == " "  # the text ends before the stop string
    assert text.content(final=True) == ""
    pieces, _ = TextStream(tiny_tokenizer()).push(step(5, 6))
    assert pieces == ["w5", " w6"]


def test_sixteen_concurrent_streams_each_equal_their_solo_answer(server):
    openai = client(server)
    prompts = [" ".join(f"w{5 + (i * 7 + j * 3) % 50}" for j in range(2 + i % 5)) for i in range(16)]
    solo = [stream_chat(openai, p, temperature=0, max_tokens=20 + i, extra_body={"method": "ar"})[0]
            for i, p in enumerate(prompts)]
    with ThreadPoolExecutor(16) as pool:
        answers = list(pool.map(lambda i: stream_chat(openai, prompts[i], temperature=0, max_tokens=20 + i,
                                                      extra_body={"method": METHODS[i % 3]})[0],
                                range(16)))
    assert answers == solo
    assert server.scheduler.running == 0


@pytest.mark.parametrize("stream", [True, False])
def test_a_client_that_goes_away_stops_its_work(server, stream):
    aborted = server.metric("verispec:request_success_total")
    before = server.metric("verispec:generation_tokens_total")
    connection = http.client.HTTPConnection(server.url.removeprefix("http://"), timeout=30)
    connection.request("POST", "/v1/chat/completions", json.dumps({
        "messages": [{"role": "user", "content": "w7"}], "max_tokens": 480, "temperature": 0,
        "stream": stream, "method": "ar"}), {"Content-Type": "application/json"})
    if stream:
        response = connection.getresponse()
        assert response.status == 200
        response.readline()  # the first event
    wait_until(lambda: server.scheduler.running == 1)
    connection.sock.shutdown(2)
    connection.close()
    wait_until(lambda: server.scheduler.running == 0, 5)
    assert server.metric("verispec:request_success_total") == aborted + 1
    _, _, text = server.request("/metrics")
    assert 'verispec:request_success_total{finished_reason="abort"}' in text
    assert server.metric("verispec:generation_tokens_total") - before < 480


BAD = [
    (b"{not json", "not valid JSON"),
    (b"[1, 2]", "JSON object"),
    ({"model": "tiny"}, "messages"),
    ({"messages": "hello"}, "messages"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "robot", "content": "w5"}]}, "role"),
    ({"messages": [{"role": "user", "content": "w5"}], "temperature": "hot"}, "temperature"),
    ({"messages": [{"role": "user", "content": "w5"}], "temperature": -1}, "greater than or equal to 0"),
    ({"messages": [{"role": "user", "content": "w5"}], "top_p": 0, "temperature": 1}, "top_p"),
    ({"messages": [{"role": "user", "content": "w5"}], "max_tokens": 0}, "max_tokens"),
    ({"messages": [{"role": "user", "content": "w5"}], "max_tokens": 2.5}, "max_tokens"),
    ({"messages": [{"role": "user", "content": "w5"}], "max_tokens": 1000}, "exceeds the model's context"),
    ({"messages": [{"role": "user", "content": " ".join(["w5"] * 600)}]}, "exceeds the model's context"),
    ({"messages": [{"role": "user", "content": " "}]}, "messages are empty"),
    ({"messages": [{"role": "user", "content": "w5"}], "n": 0}, "n"),
    ({"messages": [{"role": "user", "content": "w5"}], "n": 99}, "n is at most 16"),
    ({"messages": [{"role": "user", "content": "w5"}], "stream": "yes"}, "stream"),
    ({"messages": [{"role": "user", "content": "w5"}], "stop": [""]}, "stop strings must be non-empty"),
    ({"messages": [{"role": "user", "content": "w5"}], "method": "magic"}, "is not served here"),
    ({"messages": [{"role": "user", "content": "w5"}], "method": "eagle"}, "is not served here"),
    ({"messages": [{"role": "user", "content": "w5"}], "method": "pld", "k": -1}, "k"),
    ({"messages": [{"role": "user", "content": "w5"}], "method": "pld", "k": 65}, "k"),
    ({"messages": [{"role": "user", "content": "w5"}], "method": "pld", "model_k": 0}, "model_k"),
    ({"messages": [{"role": "user", "content": "w5"}], "top_k": -1}, "top_k"),
    ({"messages": [{"role": "user", "content": "w5"}], "method": "pld", "tree": "bushy"}, "TOPKxNODES"),
    ({"messages": [{"role": "user", "content": "w5"}], "method": "ar", "tree": "2x4"}, "chains only"),
]


def test_bad_requests_get_a_400_and_the_server_keeps_serving(server):
    for body, message in BAD:
        status, _, reply = server.request("/v1/chat/completions", body)
        assert status == 400, (body, reply)
        error = reply["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
        assert message is None or message in error["message"], (body, error)
        assert "Traceback" not in error["message"]
    status, _, reply = server.request("/v1/completions", {"prompt": 5})
    assert status == 400 and "prompt" in reply["error"]["message"]
    status, _, reply = server.request("/v1/nowhere")
    assert status == 404 and reply["error"]["code"] == 404
    status, _, reply = server.request("/v1/chat/completions", {
        "messages": [{"role": "user", "content": CHAT}], "temperature": 0, "max_tokens": 5})
    assert status == 200 and reply["usage"]["completion_tokens"] == 5


def test_a_method_the_model_cannot_run_fails_before_serving(loaded):
    from verispec.core.errors import VerispecError

    with pytest.raises(VerispecError, match="no trained eagle drafter"):
        create_app(loaded, ["eagle"])
    with pytest.raises(VerispecError, match="unknown method"):
        create_app(loaded, ["magic"])


def test_ways_of_speculating_are_bounded_least_recently_used_dropped(loaded, monkeypatch):
    from verispec.server import scheduler

    monkeypatch.setattr(scheduler, "MAX_SPECULATIONS", 3)
    body = {"messages": [{"role": "user", "content": CHAT}], "temperature": 0, "max_tokens": 2}
    long = {"messages": [{"role": "user", "content": "w7"}], "max_tokens": 400, "temperature": 0,
            "stream": True}
    with LiveServer(create_app(loaded, ["pld"])) as live:  # holds pld's default, pinned
        held = live.scheduler._speculations
        for k in (1, 2, 3):
            assert live.request("/v1/chat/completions", body | {"k": k})[0] == 200
        assert [key[1] for key in held] == [None, 2, 3]  # k=1, least recently used, dropped
        connections = []
        for k in (2, 3):  # both unpinned ways in use at once
            connection = http.client.HTTPConnection(live.url.removeprefix("http://"), timeout=30)
            connection.request("POST", "/v1/chat/completions", json.dumps(long | {"k": k}),
                               {"Content-Type": "application/json"})
            connection.getresponse().readline()
            connections.append(connection)
        wait_until(lambda: live.scheduler.running == 2)
        status, _, reply = live.request("/v1/chat/completions", body | {"k": 4})
        assert status == 400 and "all in use" in reply["error"]["message"]
        for connection in connections:
            connection.sock.shutdown(2)
            connection.close()
        wait_until(lambda: live.scheduler.running == 0)
        assert live.request("/v1/chat/completions", body | {"k": 4})[0] == 200
        assert len(held) == 3


def test_a_requests_model_k_is_its_own_way_of_speculating(loaded):
    """Two requests differing only in model_k get a speculation each (the key holds it), not the
    first one's drafters."""
    body = {"messages": [{"role": "user", "content": CHAT}], "temperature": 0, "max_tokens": 2,
            "method": "pld"}
    with LiveServer(create_app(loaded, ["pld"])) as live:
        for model_k in (2, 3, 2):
            assert live.request("/v1/chat/completions", body | {"model_k": model_k})[0] == 200
        assert sorted(key[2] for key in live.scheduler._speculations if key[2]) == [2, 3]


def test_models_health_and_metrics(server):
    _, _, models = server.request("/v1/models")
    assert models["data"][0]["verispec"] == {"methods": METHODS, "default_method": "pld"}
    assert server.request("/health")[2]["status"] == "ok"
    client(server).chat.completions.create(model="tiny", messages=[{"role": "user", "content": CHAT}],
                                           temperature=0, max_tokens=12)
    _, headers, text = server.request("/metrics")
    assert headers["content-type"].startswith("text/plain")
    for name in ["verispec:spec_decode_num_draft_tokens_total",
                 "verispec:spec_decode_num_accepted_tokens_total",
                 "verispec:spec_decode_num_accepted_tokens_per_pos_total",
                 "verispec:spec_decode_acceptance_rate_per_pos", "verispec:spec_decode_mean_accepted_tokens",
                 "verispec:time_to_first_token_seconds_bucket", "verispec:num_requests_running",
                 "verispec:num_requests_waiting", "verispec:generation_tokens_total",
                 "verispec:e2e_request_latency_seconds_count"]:
        assert name in text, name
    assert server.metric("verispec:time_to_first_token_seconds_count") >= 1


def test_a_full_queue_answers_429_with_retry_after(loaded):
    long = {"messages": [{"role": "user", "content": "w7"}], "max_tokens": 480, "temperature": 0,
            "method": "ar"}
    with LiveServer(create_app(loaded, ["ar"], max_batch=1, max_queue=1)) as live:
        with ThreadPoolExecutor(2) as pool:
            running = pool.submit(live.request, "/v1/chat/completions", long)
            wait_until(lambda: live.scheduler.running == 1)
            waiting = pool.submit(live.request, "/v1/chat/completions", long)
            wait_until(lambda: live.metric("verispec:num_requests_waiting") == 1)
            status, headers, reply = live.request("/v1/chat/completions", long)
            assert status == 429 and headers["retry-after"] == "1"
            assert reply["error"]["type"] == "rate_limit_error"
            assert running.result()[0] == waiting.result()[0] == 200
        assert live.metric("verispec:request_rejected_total") == 1


def test_sigterm_drains_requests_in_flight_and_refuses_new_ones(tiny_dir, tmp_path):
    with LiveServer(create_app(load_model(str(tiny_dir)), ["ar"])) as probe:  # a free port
        port = int(probe.url.rsplit(":", 1)[1])
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1]), "OMP_NUM_THREADS": "1"}
    process = subprocess.Popen([sys.executable, "-m", "verispec.cli", "serve", "--model", str(tiny_dir),
                                "--method", "ar", "--port", str(port), "--drain-seconds", "20"],
                               env=env, stderr=open(tmp_path / "server.log", "w"))
    try:
        live = LiveServer.__new__(LiveServer)
        live.url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            try:
                if live.request("/health", timeout=1)[0] == 200:
                    break
            except OSError:
                pass
            alive = time.monotonic() < deadline and process.poll() is None
            assert alive, (tmp_path / "server.log").read_text()
            time.sleep(0.2)
        connection = http.client.HTTPConnection(f"127.0.0.1:{port}", timeout=30)
        connection.request("POST", "/v1/chat/completions", json.dumps({
            "messages": [{"role": "user", "content": "w7"}], "max_tokens": 480, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}), {"Content-Type": "application/json"})
        response = connection.getresponse()
        response.readline()
        process.send_signal(signal.SIGTERM)
        refused, deadline = None, time.monotonic() + 10
        while refused is None and time.monotonic() < deadline:
            status, _, reply = live.request("/v1/chat/completions", {
                "messages": [{"role": "user", "content": "w7"}], "max_tokens": 2}, timeout=5)
            if status == 503:
                refused = reply
        assert refused is not None, "no 503 while draining"
        assert "shutting down" in refused["error"]["message"]
        events = response.read().decode().split("\n\n")
        assert events[-2] == "data: [DONE]"
        assert json.loads(events[-3].removeprefix("data: "))["usage"]["completion_tokens"] == 480
        assert process.wait(timeout=30) == 0
    finally:
        if process.poll() is None:
            process.kill()


FATE_COLOURS = {"tok accepted": "rgb(0, 128, 0)", "tok rejected": "rgb(205, 0, 0)",
                "tok recovered": "rgb(0, 0, 238)", "tok bonus": "rgb(0, 139, 139)",
                "tok forced": "rgb(205, 0, 205)", "tok plain": "rgb(34, 34, 34)"}


def playground(url: str, method: str, prompt: str, max_tokens: int, screenshot: Path,
               output: str = "text", schema: dict | None = None) -> tuple[list, list, float]:
    """Submit a prompt in headless Chromium (output: the format select's value, with `schema` for
    json_schema); the speculative pane's tokens (class, colour, decoration), the plain pane's
    classes, and the tau shown. Writes a screenshot."""
    if not CHROMIUM.exists():
        pytest.fail(f"{CHROMIUM} is missing: run `make install-dev` (installs Debian's chromium)")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=str(CHROMIUM), args=["--no-sandbox"])
        try:
            page = browser.new_page(viewport={"width": 1200, "height": 760})
            page.goto(url + "/", timeout=30_000)
            page.select_option("#method", method)
            page.fill("#prompt", prompt)
            page.fill("#max-tokens", str(max_tokens))
            page.select_option("#format", output)
            if schema is not None:
                page.fill("#schema", json.dumps(schema))
            page.click("#go")
            page.wait_for_selector("body[data-state=done]", timeout=300_000)
            page.screenshot(path=str(screenshot), full_page=True)
            assert page.is_hidden("#error"), page.text_content("#error")
            colours = page.eval_on_selector_all(
                "#spec .output .tok", "nodes => nodes.map(n => [n.className, getComputedStyle(n).color, "
                "getComputedStyle(n).textDecorationLine])")
            plain = page.eval_on_selector_all("#plain .output .tok", "nodes => nodes.map(n => n.className)")
            tau = float(page.text_content("#spec .tau"))
        finally:
            browser.close()
    print(f"\nplayground screenshot: {screenshot}")
    if os.environ.get("VERISPEC_SCREENSHOT_DIR"):  # keep it beyond pytest's temporary directories
        shutil.copy(screenshot, Path(os.environ["VERISPEC_SCREENSHOT_DIR"]) / screenshot.name)
    for cls, colour, decoration in colours:
        assert colour == FATE_COLOURS[cls], cls
        assert (decoration == "line-through") == (cls == "tok rejected")
    if output == "text":
        assert plain and set(plain) == {"tok plain"}  # plain decoding drafts nothing: uncoloured
    else:  # under a grammar, plain decoding's steps with forced tokens are painted
        assert plain and set(plain) <= {"tok plain", "tok forced", "tok bonus"}
    return colours, plain, tau


def test_playground_paints_tokens_by_fate_in_chromium(server, tmp_path):
    colours, _, tau = playground(server.url, "early-exit", "w10 w11 w12 w13 w10 w11 w12", 48,
                                 tmp_path / "playground-tiny.png")
    assert {"tok accepted", "tok rejected", "tok recovered"} <= {cls for cls, _, _ in colours}
    assert tau > 1


@pytest.mark.slow
def test_builtin_model_answers_equal_verispec_generate(capsys, tmp_path):
    from verispec.methods import DEFAULT_METHOD

    loaded = load_model("smollm2-135m-instruct")
    prompt = "Name three rivers in Europe."
    taus = {}
    with LiveServer(create_app(loaded)) as live:
        openai = client(live)
        for method in [DEFAULT_METHOD, "ar"]:
            expected = generated("smollm2-135m-instruct", prompt, method, 48, raw=False, capsys=capsys)
            reply = openai.chat.completions.create(
                model="smollm2", messages=[{"role": "user", "content": prompt}], temperature=0,
                max_tokens=48, extra_body={"method": method})
            streamed, _ = stream_chat(openai, prompt, temperature=0, max_tokens=48,
                                      extra_body={"method": method})
            assert reply.choices[0].message.content == streamed == expected, method
            taus[method] = reply.model_extra["verispec"]["mean_accepted_tokens"]
        colours, _, tau = playground(live.url, DEFAULT_METHOD, prompt, 64,
                                     tmp_path / "playground-smollm2.png")
        assert "tok accepted" in {cls for cls, _, _ in colours} and tau > 1
    print(f"\ntau by method: {taus}")


@pytest.mark.slow
def test_a_thousand_varied_requests_keep_memory_flat(server):
    """1000 requests varying method, k, tree, n, prompt length and streaming: after 200 that
    go through every variety once (caches, pools, allocator), RSS grows by under 10 MiB."""
    import psutil

    process = psutil.Process()
    kinds = [(method, k, tree) for method in METHODS for k in (None, 1, 4, 8)
             for tree in ((None, "2x4", "4x16") if method == "pld" else (None,))]

    def body(i: int) -> dict:
        method, k, tree = kinds[i % len(kinds)]
        words = " ".join(f"w{5 + (i * 7 + j) % 50}" for j in range(2 + (i * 13) % 120))
        return {"messages": [{"role": "user", "content": words}], "temperature": 0 if i % 3 else 0.8,
                "max_tokens": 4 + i % 29, "n": 1 + i % 3, "stream": i % 2 == 0, "method": method,
                **({} if k is None else {"k": k}), **({} if tree is None else {"tree": tree})}

    def burst(indices: range) -> None:
        for i in indices:
            assert server.request("/v1/chat/completions", body(i))[0] == 200, body(i)

    burst(range(200))
    start = process.memory_info().rss
    burst(range(200, 1000))
    grown = (process.memory_info().rss - start) / 2**20
    print(f"\nRSS after 200 requests {start / 2**20:.1f} MiB, after 1000: +{grown:.1f} MiB")
    assert grown < 10
    assert server.scheduler.running == 0 and server.scheduler.reserved_kv_tokens == 0
    assert threading.active_count() < 20


def test_the_servers_drafting_options_are_each_requests_defaults(loaded):
    """`verispec serve --k 3 --tree 2x3 --max-ngram 3` (DraftOptions) reach every request; a
    request's own k and tree override them, and a chain-only method gets no tree."""
    from verispec.core.tree import TreeSettings
    from verispec.options import DraftOptions
    from verispec.server.requests import ChatBody, CompletionBody, parse_body, to_request

    defaults = DraftOptions(k=3, tree=TreeSettings(2, 3), max_ngram=3)

    def request(**fields):
        body = parse_body(json.dumps({"messages": [{"role": "user", "content": "w5 w6"}], "max_tokens": 4,
                                      **fields}).encode(), ChatBody)
        return to_request(body, loaded, ["pld", "lookahead"], 4, defaults)

    assert request(method="pld").options == defaults
    assert request(method="pld", k=5, tree="4x8").options == DraftOptions(k=5, tree=TreeSettings(4, 8),
                                                                          max_ngram=3)
    assert request(method="lookahead").options.tree is None
    # EAGLE's depth behind a lookup: the body's, else the server's
    assert request(method="pld", model_k=2).options == replace(defaults, model_k=2)
    assert to_request(parse_body(json.dumps({"prompt": "w5", "max_tokens": 2}).encode(), CompletionBody),
                      loaded, ["pld"], 4, replace(defaults, model_k=3)).options.model_k == 3
