"""`verispec serve` under hostile traffic: a request that fails (or would) never harms the others,
the door refuses what it must (413, 415, 401, Host, depth, ranges, refused fields), logprobs come
from the target and equal plain decoding's under speculation, random bodies never get a 5xx,
text and stop strings are found incrementally, memory is budgeted."""

from __future__ import annotations

import http.client
import json
import os
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from tests.serving import LiveServer, wait_until
from tests.tiny import save_tiny, tiny_tokenizer
from verispec.core.policies import ConstantK
from verispec.core.sampling import warp_probs
from verispec.core.stopping import StoppingRules
from verispec.core.tree import TreeSettings
from verispec.core.types import Fate, Proposal, SamplingParams, Step
from verispec.decoding.engine import RowFailure
from verispec.decoding.sequence import SequenceSpec, Speculation
from verispec.display import TokenPieces
from verispec.drafters.base import Drafter
from verispec.methods import METHODS, TREE_METHODS, build_engine, build_speculation
from verispec.model.loading import load_model
from verispec.options import DraftOptions
from verispec.server import create_app
from verispec.server.app import MAX_BODY_BYTES
from verispec.server.requests import REFUSED as REFUSED_FIELDS
from verispec.server.requests import ChatBody, CompletionBody

CHAT = "w10 w11 w12 w10 w11"
CHAT_URL = "/v1/chat/completions"


@pytest.fixture(scope="module")
def loaded(tiny_dir):
    return load_model(str(tiny_dir))


@pytest.fixture(scope="module")
def server(loaded):
    with LiveServer(create_app(loaded, ["pld", "ar"])) as live:
        yield live


def chat(prompt: str, **fields) -> dict:
    return {"messages": [{"role": "user", "content": prompt}], "temperature": 0, "max_tokens": 16} | fields


def post(server: LiveServer, path: str, raw: bytes, headers: dict[str, str]) -> tuple[int, dict, bytes]:
    """A POST with exactly these bytes and headers (no Content-Type unless given)."""
    connection = http.client.HTTPConnection(server.url.removeprefix("http://"), timeout=30)
    try:
        connection.request("POST", path, raw, headers)
        response = connection.getresponse()
        return response.status, dict(response.headers), response.read()
    finally:
        connection.close()


# -- isolation ----------------------------------------------------------------------------------

@pytest.mark.parametrize("temperature", [1e-40, 1e-300, 1e-6, 1e-5, 1e-3, 1.0, 1e3, 1e30])
@pytest.mark.parametrize("top_p", [1e-300, 0.5, 1.0])
def test_warped_probabilities_are_finite_at_any_accepted_setting(temperature, top_p):
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0)) * 30  # [3, vocab]
    params = SamplingParams(True, temperature, top_k=0, top_p=top_p)
    probs = warp_probs(logits, params)
    assert torch.isfinite(probs).all()
    assert torch.allclose(probs.sum(-1), torch.ones(3))
    if temperature < 1e-5:  # below the floor: greedy, one-hot on the argmax
        assert params.greedy and torch.equal(probs.argmax(-1), logits.argmax(-1))
        assert torch.equal(probs.max(-1).values, torch.ones(3))


class BrokenDrafter(Drafter):
    """Drafts random tokens; raises in `propose` or `commit` (as a bug in a drafter would)."""

    def __init__(self, where: str) -> None:
        self.where = where
        self.proposed = 0

    def reset(self) -> None:
        pass

    def propose(self, request) -> Proposal:
        self.proposed += 1
        if self.where == "propose" and self.proposed == 3:
            raise RuntimeError("drafter broke")
        return Proposal(torch.tensor([5, 6]))

    def commit(self, num_accepted: int) -> None:
        if self.where == "commit" and self.proposed == 3:
            raise RuntimeError("drafter broke")


@pytest.mark.parametrize("where", ["propose", "commit"])
def test_a_row_that_fails_in_a_step_leaves_the_others_unchanged(loaded, where):
    prompts = [[5, 6, 7, 5, 6], [9, 10, 11], [20, 21, 20, 21]]
    stopping = StoppingRules.build(12)
    engine = build_engine(loaded, "pld")
    solo = [engine.generate(SequenceSpec(p, stopping)).token_ids for p in prompts]
    broken = engine.add(SequenceSpec([7, 8], stopping),
                        speculation=Speculation(BrokenDrafter(where), ConstantK(2)))
    ids = [engine.add(SequenceSpec(p, stopping))[0] for p in prompts]
    tokens: dict[int, list[int]] = {i: [] for i in ids}
    failures = []
    while engine.active:
        for row_id, step in engine.step():
            if isinstance(step, RowFailure):
                failures.append((row_id, str(step.error)))
            else:
                tokens.setdefault(row_id, []).extend(step.tokens)
    assert failures == [(broken[0], "drafter broke")]
    assert [tokens[i] for i in ids] == solo


def test_a_failing_request_beside_normal_ones_fails_alone(loaded, monkeypatch):
    """A request whose step raises inside the engine (injected: its rows' verification raises)
    gets a 500, or an error event then [DONE] when streaming; the requests beside it answer what
    they answer alone; a degenerate temperature is greedy."""
    from verispec.decoding import sequence as sequence_module

    settle = sequence_module.Row.settle

    def settle_or_break(row, *args):
        if row.stopping.max_new_tokens == 13:  # the marked request
            raise FloatingPointError("injected")
        return settle(row, *args)

    monkeypatch.setattr(sequence_module.Row, "settle", settle_or_break)
    prompts = [f"w{10 + i} w{11 + i} w{12 + i} w{10 + i}" for i in range(6)]
    with LiveServer(create_app(loaded, ["pld", "ar"])) as live:
        solo = [live.request(CHAT_URL, chat(p, max_tokens=20))[2]["choices"][0]["message"]["content"]
                for p in prompts]

        def normal(i: int) -> str:
            body = chat(prompts[i], max_tokens=20, method=["pld", "ar"][i % 2])
            if i == 0:
                body |= {"temperature": 1e-40, "top_p": 1e-300}  # degenerate: handled as greedy
            status, _, reply = live.request(CHAT_URL, body)
            assert status == 200, reply
            return reply["choices"][0]["message"]["content"]

        with ThreadPoolExecutor(8) as pool:
            answers = pool.map(normal, range(6))
            failing = pool.submit(live.request, CHAT_URL, chat(CHAT, max_tokens=13))
            stream = json.dumps(chat(CHAT, max_tokens=13, stream=True, n=2)).encode()
            failing_stream = pool.submit(post, live, CHAT_URL, stream, {"Content-Type": "application/json"})
            assert list(answers) == solo
            status, _, reply = failing.result()
            assert status == 500 and "FloatingPointError" in reply["error"]["message"]
            status, _, raw = failing_stream.result()
        events = raw.decode().strip().split("\n\n")
        assert status == 200 and events[-1] == "data: [DONE]"
        assert json.loads(events[-2].removeprefix("data: "))["error"]["code"] == 500
        assert live.request(CHAT_URL, chat(CHAT))[0] == 200
        assert live.scheduler.running == 0 and live.scheduler.reserved_kv_tokens == 0


def test_a_dead_engine_thread_shows_in_health_and_refuses_at_once(loaded, monkeypatch):
    with LiveServer(create_app(loaded, ["ar"])) as live:
        assert live.request("/health")[0] == 200

        def die() -> None:
            raise MemoryError("the worker's own bookkeeping broke")

        monkeypatch.setattr(live.scheduler, "_drop_cancelled", die)
        status, _, reply = live.request(CHAT_URL, chat(CHAT), timeout=10)
        assert status == 503 and "engine thread died" in reply["error"]["message"]
        status, _, reply = live.request("/health")
        assert status == 503 and "MemoryError" in reply["error"]["message"]
        status, _, _ = live.request(CHAT_URL, chat(CHAT), timeout=5)
        assert status == 503


# -- memory --------------------------------------------------------------------------------------

def test_kv_budget_queues_what_does_not_fit_and_refuses_what_never_could(loaded):
    one = chat(CHAT, max_tokens=60, method="ar")  # prompt ~ 15 + 60 + 160 room: ~ 235 tokens
    with LiveServer(create_app(loaded, ["ar"], max_kv_tokens=300, max_queue=0)) as live:
        status, _, reply = live.request(CHAT_URL, one | {"n": 2})
        assert status == 400 and reply["error"]["param"] == "max_tokens"
        assert "--max-kv-tokens 300" in reply["error"]["message"]
        peak = []
        with ThreadPoolExecutor(2) as pool:
            first = pool.submit(live.request, CHAT_URL, one)
            wait_until(lambda: live.scheduler.running == 1)
            second = pool.submit(live.request, CHAT_URL, one)  # no room: 429 (max_queue 0)
            while not first.done():  # sampled, sleeping between reads: a spinning loop holds
                peak.append(live.scheduler.reserved_kv_tokens)  # the GIL the server needs
                time.sleep(0.001)
            assert first.result()[0] == 200 and second.result()[0] == 429
        assert 0 < max(peak) <= 300
        # --max-queue 0 still serves a request that can start at once.
        assert live.request(CHAT_URL, one)[0] == 200


def test_a_finished_requests_caches_hold_no_memory(loaded):
    engine = build_engine(loaded, "early-exit")
    engine.generate(SequenceSpec([5, 6, 7], StoppingRules.build(40)))
    pooled = [pair for pool in engine._free.values() for pair in pool]
    assert pooled and all(target.lean.caches[0].keys is None for target, _ in pooled)
    assert all(drafter.lm.lean.caches[0].keys is None for _, drafter in pooled if drafter is not None)


# -- logprobs -------------------------------------------------------------------------------------

def _served_methods(loaded) -> list[tuple[str, DraftOptions]]:
    """Every method the tiny model can run (the trained-drafter ones need the built-in model);
    `draft` drafts with a copy of the target (every draft accepted)."""
    draft = load_model(str(save_tiny(_tmp_dir(), seed=0)))
    runnable = []
    for name in METHODS:
        options = DraftOptions(draft=draft) if name == "draft" else DraftOptions()
        try:
            build_speculation(loaded, name, options)
        except Exception as error:  # noqa: BLE001 - only "no trained drafter ships" is expected
            assert "no trained" in str(error), (name, error)
            continue
        runnable.append((name, options))
        if name in TREE_METHODS:  # and as a tree, whose accepted path is not rows 0..n of the block
            runnable.append((name, replace(options, tree=TreeSettings(4, 16))))
    return runnable


def _tmp_dir():
    import tempfile
    from pathlib import Path

    return Path(tempfile.mkdtemp())


def test_logprobs_under_speculation_equal_plain_decodings_for_every_method(loaded):
    prompt, stopping = [5, 6, 7, 8, 5, 6, 7, 8, 5, 6], StoppingRules.build(24)

    def run(name: str, options: DraftOptions):
        engine = build_engine(loaded, name, options)
        row = engine.add(SequenceSpec(prompt, stopping, logprobs=3))[0]
        steps = []
        while engine.active:
            steps += [step for row_id, step in engine.step() if row_id == row]
        return steps

    plain = [lp for step in run("ar", DraftOptions()) for lp in step.logprobs]
    methods = _served_methods(loaded)
    accepted: dict[str, int] = {}
    off_first_branch: dict[str, bool] = {}
    assert {"pld", "self-int4", "lookahead", "early-exit", "draft"} <= {name for name, _ in methods}
    for name, options in methods:
        steps = run(name, options)
        assert name == "ar" or sum(step.num_drafted for step in steps) > 0, name  # it drafted
        accepted[name] = sum(step.num_accepted for step in steps)
        off_first_branch[name] = any(
            step.tree is not None and step.tree.path != list(range(len(step.tree.path))) for step in steps)
        mine = [lp for step in steps for lp in step.logprobs]
        assert [lp.token for lp in mine] == [lp.token for lp in plain], name
        for a, b in zip(mine, plain):
            assert a.logprob == pytest.approx(b.logprob, abs=1e-4), name
            assert [t for t, _ in a.top] == [t for t, _ in b.top], name
            assert [v for _, v in a.top] == pytest.approx([v for _, v in b.top], abs=1e-4), name
    assert accepted["draft"] > 0 < accepted["pld"]
    assert any(off_first_branch.values())  # some tree step accepted a path off rows 0..n
    # The reported value is log softmax of the target's own logits for that token.
    with torch.no_grad():
        logits = loaded.model(torch.tensor([prompt])).logits[0, -1].float()
    assert plain[0].logprob == pytest.approx(float(logits.log_softmax(-1)[plain[0].token]), abs=1e-4)


def test_logprobs_in_both_endpoints_shapes(server):
    status, _, reply = server.request(CHAT_URL, chat(CHAT, logprobs=True, top_logprobs=2, method="pld"))
    assert status == 200
    content = reply["choices"][0]["logprobs"]["content"]
    assert len(content) == reply["usage"]["completion_tokens"]
    assert "".join(entry["token"] for entry in content).replace(" ", "").replace("<bos>", "") == \
        reply["choices"][0]["message"]["content"].replace(" ", "")
    assert all(len(entry["top_logprobs"]) == 2 and entry["logprob"] <= 0 for entry in content)
    assert all(entry["logprob"] == pytest.approx(entry["top_logprobs"][0]["logprob"]) for entry in content)
    status, _, reply = server.request("/v1/completions", {"prompt": "w5 w6 w7", "max_tokens": 6,
                                                          "temperature": 0, "logprobs": 1})
    logprobs = reply["choices"][0]["logprobs"]
    assert status == 200 and len(logprobs["tokens"]) == len(logprobs["token_logprobs"]) == 6
    assert server.request(CHAT_URL, chat(CHAT))[2]["choices"][0]["logprobs"] is None


# -- the door ------------------------------------------------------------------------------------

REFUSED = [
    ({"logit_bias": {"5": 10}}, "logit_bias"),
    ({"presence_penalty": 0.5}, "presence_penalty"),
    ({"frequency_penalty": -1}, "frequency_penalty"),
    ({"response_format": {"type": "json_schema"}}, "response_format"),  # no schema given
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    ({"seed": 2**64}, "seed"),
    ({"seed": -(2**63) - 1}, "seed"),
    ({"temperature": 1e309}, None),  # json reads it as inf: "not a JSON number"
    ({"top_logprobs": 3}, "top_logprobs"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"method": "pld", "tree": "4x65"}, "tree"),
    ({"stop": ["x" * 257]}, "stop"),
    ({"stop": ["a", "b", "c", "d", "e"]}, "stop"),
]


@pytest.mark.parametrize("fields, param", REFUSED)
def test_fields_not_honoured_are_refused_by_name(server, fields, param):
    status, _, reply = server.request(CHAT_URL, chat(CHAT) | fields)
    assert status == 400, reply
    assert reply["error"]["param"] == param, reply


def test_harmless_values_of_refused_fields_pass(server):
    fields = {"logit_bias": {}, "presence_penalty": 0, "response_format": {"type": "text"}, "tools": [],
              "tool_choice": "none", "user": "someone", "max_completion_tokens": 3}
    status, _, reply = server.request(CHAT_URL, chat(CHAT) | fields)
    assert status == 200 and reply["usage"]["completion_tokens"] == 3, reply


def test_body_size_content_type_depth_and_constants(server):
    json_header = {"Content-Type": "application/json"}
    body = json.dumps(chat(CHAT)).encode()
    assert post(server, CHAT_URL, body, {})[0] == 415
    assert post(server, CHAT_URL, body, {"Content-Type": "text/plain"})[0] == 415
    assert post(server, CHAT_URL, body, {"Content-Type": "application/json; charset=utf-8"})[0] == 200
    big = json.dumps(chat(CHAT, pad="x" * (1 << 20))).encode()
    assert post(server, CHAT_URL, big, json_header)[0] == 413
    # Chunked, without a Content-Length: counted as it arrives.
    host, port = server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as raw:
        raw.sendall(f"POST {CHAT_URL} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                    "Transfer-Encoding: chunked\r\n\r\n".encode())
        for _ in range(20):
            raw.sendall(b"10000\r\n" + b" " * 0x10000 + b"\r\n")
        raw.sendall(b"0\r\n\r\n")
        assert raw.recv(100).startswith(b"HTTP/1.1 413")
    deep = b'{"messages": ' + b"[" * 100 + b"]" * 100 + b"}"
    status, _, reply = post(server, CHAT_URL, deep, json_header)
    assert status == 400 and b"nests deeper" in reply
    deeper = b'{"x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    assert post(server, CHAT_URL, deeper, json_header)[0] == 400
    nan = json.dumps(chat(CHAT, temperature=0.5)).replace("0.5", "NaN").encode()
    status, _, reply = post(server, CHAT_URL, nan, json_header)
    assert status == 400 and b"not a JSON number" in reply


def test_api_key_host_check_and_cors(loaded):
    app = create_app(loaded, ["ar"], api_key="s3cret", cors_origins=["https://app.example"])
    with LiveServer(app) as live:
        assert live.request(CHAT_URL, chat(CHAT))[0] == 401
        assert live.request("/v1/models")[0] == 401
        assert live.request("/health")[0] == 200 and live.request("/metrics")[0] == 200
        body = json.dumps(chat(CHAT)).encode()
        headers = {"Content-Type": "application/json"}
        status, reply_headers, _ = post(live, CHAT_URL, body, headers | {"Authorization": "Bearer wrong"})
        assert status == 401 and reply_headers["www-authenticate"] == "Bearer"
        assert post(live, CHAT_URL, body, headers | {"Authorization": "Bearer s3cret"})[0] == 200
        # DNS rebinding: a page at evil.example resolving to 127.0.0.1 sends its own Host.
        status, _, reply = post(live, CHAT_URL, body, headers | {"Authorization": "Bearer s3cret",
                                                                "Host": "evil.example:8000"})
        assert status == 400 and b"Host" in reply
        preflight = {"Origin": "https://app.example", "Access-Control-Request-Method": "POST"}
        connection = http.client.HTTPConnection(live.url.removeprefix("http://"), timeout=30)
        connection.request("OPTIONS", CHAT_URL, headers=preflight)
        response = connection.getresponse()
        assert response.headers["access-control-allow-origin"] == "https://app.example"
        connection.close()
    with LiveServer(create_app(loaded, ["ar"], host="0.0.0.0")) as live:  # no Host check, no CORS
        body = json.dumps(chat(CHAT, max_tokens=2)).encode()
        status, headers, _ = post(live, CHAT_URL, body, {"Content-Type": "application/json",
                                                         "Host": "my-box:8000", "Origin": "https://x.example"})
        assert status == 200 and "access-control-allow-origin" not in headers


# -- fuzzing -------------------------------------------------------------------------------------

# Every code point, lone surrogates included (JSON's \\ud800 escapes spell them), and the strings
# that break text handling most often, drawn on purpose: lone and doubled surrogates, NUL, right-
# to-left and isolate marks, a BOM, the last code point, a combining mark, the tiny vocabulary's
# words; and, in the fields the server reads as text, strings of 10,000 code points.
CHARS = st.characters(exclude_categories=[])
HOSTILE = ["\ud800", "\udfff", "\udbff\udbff", "a\ud800b", "\x00", "w5\x00w6", "\u202e", "\u200f", "\u2067",
           "\ufeff", "\U0010ffff", "e\u0301", "w5", " ", "", "\n", "<eos>"]
SHORT = st.lists(CHARS | st.sampled_from(HOSTILE), max_size=12).map("".join)
TEXT = SHORT | st.builds(lambda piece, n: (piece * n)[:n], st.text(CHARS, min_size=1, max_size=4)
                         | st.sampled_from([h for h in HOSTILE if h]), st.just(10_000))
SCALARS = (st.none() | st.booleans() | st.integers(min_value=-(2**70), max_value=2**70)
           | st.floats() | SHORT)  # floats: inf and nan too (json writes them as bare words)
VALUES = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=4)
                      | st.dictionaries(SHORT, inner, max_size=4), max_leaves=12)
# Every field either body type reads, every refused one, some OpenAI fields ignored and a key that
# is no text. Each request is a well-typed base (so that text reaches the tokenizer) with up to
# three fields replaced or added, each in its own shape, in its shape with members of any JSON
# type, or any JSON at all: the type confusions, a few at a time so that the rest still validates.
FIELDS = sorted(set(ChatBody.model_fields) | set(CompletionBody.model_fields) | set(REFUSED_FIELDS)
                | {"user", "metadata", "store", "\ud800"})
ROLES = st.sampled_from(["user", "system", "assistant", "developer", "robot"])


def parts(text: st.SearchStrategy, kind: st.SearchStrategy = st.just("text")) -> st.SearchStrategy:
    return st.lists(st.fixed_dictionaries({"type": kind, "text": text}), min_size=1, max_size=2)


def messages(role: st.SearchStrategy, content: st.SearchStrategy) -> st.SearchStrategy:
    return st.lists(st.fixed_dictionaries({"role": role, "content": content}), min_size=1, max_size=3)


WELL_TYPED = {
    "messages": messages(ROLES, TEXT | parts(TEXT)),
    "prompt": TEXT | st.lists(st.integers(-2, 2**64), min_size=1, max_size=4),
    "max_tokens": st.integers(-3, 12), "temperature": st.sampled_from([0, 0.7]),
    "prediction": st.fixed_dictionaries({"type": st.just("content"), "content": TEXT | parts(TEXT)}),
    "response_format": st.fixed_dictionaries({
        "type": st.sampled_from(["text", "json_object", "json_schema"]),
        "json_schema": st.fixed_dictionaries({"name": TEXT, "schema": VALUES})}),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
    "stop": TEXT | st.lists(TEXT, max_size=5), "regex": TEXT, "grammar": TEXT, "tree": TEXT,
    "method": st.sampled_from(list(METHODS)) | TEXT,
}
CONFUSED = {  # the shape kept, its members of any type
    "messages": messages(ROLES | VALUES, TEXT | parts(TEXT | VALUES, st.just("text") | VALUES) | VALUES),
    "prediction": st.fixed_dictionaries({"type": st.just("content") | VALUES,
                                         "content": TEXT | parts(TEXT | VALUES) | VALUES}),
    "response_format": st.fixed_dictionaries({"type": VALUES, "json_schema": VALUES}),
    "stream_options": st.fixed_dictionaries({"include_usage": VALUES}),
}
FIELD = st.sampled_from(FIELDS).flatmap(lambda name: st.tuples(
    st.just(name), WELL_TYPED.get(name, VALUES) | CONFUSED.get(name, VALUES) | VALUES))
BASE = st.fixed_dictionaries({name: WELL_TYPED[name] for name in ("messages", "prompt", "max_tokens",
                                                                  "temperature")})
BODIES = st.builds(lambda base, fields: base | dict(fields), BASE, st.lists(FIELD, max_size=3)
                   ) | VALUES  # and bodies that are not objects at all
EXAMPLES = int(os.environ.get("VERISPEC_FUZZ_EXAMPLES", 400))  # docs/serving.md: how soon it finds


@settings(max_examples=EXAMPLES, deadline=None)  # every health check on
@given(body=BODIES, path=st.sampled_from([CHAT_URL, "/v1/completions"]))
def test_random_bodies_never_get_a_5xx(server, body, path):
    raw = json.dumps(body).encode()
    # A body over the limit is refused (413) before it is read, so the client's send breaks
    # (test_body_size_content_type_depth_and_constants sends those). Rare here: it takes several
    # 10,000-code-point strings of astral characters.
    assume(len(raw) <= MAX_BODY_BYTES)
    status, _, reply = server.request(path, raw, timeout=60)
    assert status < 500, (body, reply)
    if status != 200:
        assert set(reply["error"]) == {"message", "type", "param", "code"}


@pytest.mark.parametrize("field, value", [
    ("messages", [{"role": "user", "content": "w5 \ud800"}]), ("messages", [{"role": "user", "content": [
        {"type": "text", "text": "\udfff"}]}]), ("prompt", "\ud800"), ("stop", ["\ud800"]),
    ("method", "\ud800"), ("regex", "w[\ud800]"), ("prediction", {"type": "content", "content": "\ud800"}),
    ("\ud800", 1)])
def test_a_lone_surrogate_is_a_400_naming_its_field(server, field, value):
    """JSON may escape a lone UTF-16 surrogate; it is not text. (The tokenizer raised a TypeError
    on one in a message: a 500.)"""
    body = {"messages": [{"role": "user", "content": CHAT}], "prompt": "w5", "max_tokens": 2} | {field: value}
    for path in (CHAT_URL, "/v1/completions"):
        status, _, reply = server.request(path, json.dumps(body).encode())
        assert status == 400 and "surrogate" in reply["error"]["message"], (field, reply)
        assert reply["error"]["param"] == field.encode("utf-8", "backslashreplace").decode()


@pytest.mark.parametrize("text", ["w5\x00w6", "\u202ew5 w6\u202c", "\ufeffw5", "w5 " * 3333 + "w"])
def test_nul_rtl_marks_a_bom_and_10k_code_points_are_text(server, text):
    """Valid but hostile text is answered (or, 10,000 code points, refused as too long for the
    context: the scheduler names max_tokens), never a 5xx; bytes that are not UTF-8 are a 400."""
    status, _, reply = server.request(CHAT_URL, chat(text, max_tokens=2))
    assert status == 200 or (status == 400 and "context" in reply["error"]["message"]
                             and len(text) >= 10_000), reply
    status, _, reply = server.request(CHAT_URL, b'{"messages": [{"role": "user", "content": "\xff"}]}')
    assert status == 400 and "not valid JSON" in reply["error"]["message"]


def test_the_server_still_answers_after_the_fuzzing(server):
    status, _, reply = server.request(CHAT_URL, chat(CHAT, max_tokens=5))
    assert status == 200 and reply["usage"]["completion_tokens"] == 5
    assert server.scheduler.running == 0 and server.scheduler.reserved_kv_tokens == 0


# -- text ----------------------------------------------------------------------------------------

def _steps(tokens: list[int], sizes: list[int]) -> list[Step]:
    steps, i = [], 0
    for size in sizes * len(tokens):
        if i >= len(tokens):
            break
        block = tokens[i: i + size]
        steps.append(Step(tokens=block, fates=[Fate.BONUS] * len(block)))
        i += size
    return steps


@pytest.fixture(scope="module")
def smollm2_tokenizer():
    try:
        return load_model("smollm2-135m-instruct").tokenizer
    except Exception as error:  # noqa: BLE001 - the built-in model is cached on these machines
        pytest.skip(f"built-in model unavailable: {error}")


TEXTS = st.lists(st.sampled_from(list("ab cé€😀\n.,") + ["stop", "ST"]), min_size=1, max_size=40).map("".join)


@settings(max_examples=80, deadline=None)
@given(text=TEXTS, sizes=st.lists(st.integers(1, 4), min_size=1, max_size=4))
def test_incremental_pieces_equal_the_whole_decoding(smollm2_tokenizer, text, sizes):
    tokens = smollm2_tokenizer(text)["input_ids"]
    pieces = TokenPieces(smollm2_tokenizer)
    shown = "".join(p for step in _steps(tokens, sizes) for p in pieces.push(step)[0])
    assert shown == smollm2_tokenizer.decode(tokens, skip_special_tokens=True)


def _cut_by_whole_text(rules: StoppingRules, generated: list[int], block: list[int]) -> tuple[int, bool]:
    """StoppingRules.cut as it was: decoding the whole answer at every token."""
    longest = max(len(s) for s in rules.stop_strings)
    previous = len(rules.tokenizer.decode(generated))
    for i, token in enumerate(block):
        if token in rules.eos_token_ids or len(generated) + i + 1 >= rules.max_new_tokens:
            return i + 1, True
        text = rules.tokenizer.decode(generated + block[: i + 1])
        if any(s in text[max(0, previous - longest):] for s in rules.stop_strings):
            return i + 1, True
        previous = len(text)
    return len(block), False


@settings(max_examples=80, deadline=None)
@given(text=TEXTS, stops=st.lists(st.sampled_from(["stop", "é€", "😀", "c\n", "a b c a"]), min_size=1,
                                  max_size=3), size=st.integers(1, 5))
def test_stop_search_on_a_tail_agrees_with_the_whole_text(smollm2_tokenizer, text, stops, size):
    tokens = smollm2_tokenizer(text * 4)["input_ids"]
    rules = StoppingRules.build(10_000, None, stops, smollm2_tokenizer)
    for start in range(0, len(tokens), size):
        generated, block = tokens[:start], tokens[start: start + size]
        assert rules.cut(generated, block) == _cut_by_whole_text(rules, generated, block)


def test_the_text_stream_holds_back_only_a_stop_strings_beginning():
    from verispec.server.text import TextStream

    text = TextStream(tiny_tokenizer(), ("w9 w9",))
    out = []
    for token in [5, 9, 6, 9, 9, 7]:
        text.push(Step(tokens=[token], fates=[Fate.BONUS]))
        out.append(text.content(final=False))
    assert out == ["w5", " ", "w9 w6", " ", "", ""]  # "w9" held until it is not "w9 w9"
    assert text.stopped
    assert len(text.pending) < 20  # only the unsent text is kept and searched
