"""`verispec serve` under sampling, through the real openai client: temperature > 0 samples (other
seeds give other answers, the same seed the same answer), each answer is what `verispec generate`
samples with that seed, and n > 1 gives n samples seeded seed, seed + 1, ... (streamed too)."""

from __future__ import annotations

import json

import pytest
from openai import OpenAI

from tests.serving import LiveServer
from verispec.cli import main
from verispec.model.loading import load_model
from verispec.server import create_app

CHAT = "w10 w11 w12 w10 w11"
NEW = 16


@pytest.fixture(scope="module")
def server(tiny_dir):
    with LiveServer(create_app(load_model(str(tiny_dir)), ["early-exit", "ar"])) as live:
        yield live


def client(server: LiveServer) -> OpenAI:
    return OpenAI(base_url=server.url + "/v1", api_key="unused", timeout=60, max_retries=0)


def sampled_by_cli(model_dir, method: str, seed: int, temperature: float, top_p: float, capsys) -> str:
    """What `verispec generate --json` samples for the chat prompt with this seed."""
    code = main(["generate", "--model", str(model_dir), "--method", method, "--prompt", CHAT,
                 "--max-new-tokens", str(NEW), "--temperature", str(temperature), "--top-p", str(top_p),
                 "--seed", str(seed), "--json"])
    assert code == 0
    return json.loads(capsys.readouterr().out)["text"]


def ask(server: LiveServer, **kwargs):
    return client(server).chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": CHAT}], max_tokens=NEW, **kwargs)


@pytest.mark.parametrize("method", ["early-exit", "ar"])
def test_temperature_samples_and_the_seed_repeats(server, tiny_dir, capsys, method):
    body = {"temperature": 1.0, "extra_body": {"method": method}}
    answers = {seed: ask(server, seed=seed, **body) for seed in (7, 8, 9)}
    texts = {seed: reply.choices[0].message.content for seed, reply in answers.items()}
    assert len(set(texts.values())) == 3, texts  # sampling happened: three seeds, three answers
    assert ask(server, seed=7, **body).choices[0].message.content == texts[7]  # and repeats
    assert texts[7] == sampled_by_cli(tiny_dir, method, 7, 1.0, 1.0, capsys)
    greedy = ask(server, temperature=0, extra_body={"method": method}).choices[0].message.content
    assert greedy not in texts.values()
    for reply in answers.values():
        assert reply.usage.completion_tokens == NEW
        extra = reply.model_extra["verispec"]
        assert extra["method"] == method
        if method == "early-exit":  # the drafter sampled drafts, the verifier judged them
            assert extra["acceptance_by_position"] and extra["mean_accepted_tokens"] > 1


def test_n_choices_are_the_samples_seeded_one_after_another(server, tiny_dir, capsys):
    body = {"temperature": 0.9, "top_p": 0.95, "seed": 11, "n": 3, "extra_body": {"method": "early-exit"}}
    reply = ask(server, **body)
    texts = [choice.message.content for choice in sorted(reply.choices, key=lambda c: c.index)]
    assert len(texts) == 3 and len(set(texts)) == 3, texts
    assert texts == [sampled_by_cli(tiny_dir, "early-exit", 11 + i, 0.9, 0.95, capsys) for i in range(3)]
    assert NEW < reply.usage.completion_tokens <= 3 * NEW  # every choice counted (some may stop early)
    chunks = list(client(server).chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": CHAT}], max_tokens=NEW, stream=True, **body))
    streamed = ["", "", ""]
    for chunk in chunks:
        for choice in chunk.choices:
            streamed[choice.index] += choice.delta.content or ""
    assert streamed == texts
