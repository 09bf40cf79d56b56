"""Predicted outputs through the real openai client and the CLI: the same answer as without,
usage.completion_tokens_details counting the accepted and rejected prediction tokens; a bad
prediction is a 400 naming the field."""

from __future__ import annotations

import json

import openai as openai_module
import pytest
from openai import OpenAI

from tests.serving import LiveServer
from verispec.cli import main
from verispec.model.loading import load_model
from verispec.server import create_app

CHAT = "w20 w21 w22 w20"  # an answer with no special tokens, so its text reads back whole


@pytest.fixture(scope="module")
def server(tiny_dir):
    with LiveServer(create_app(load_model(str(tiny_dir)), ["ar", "pld"])) as live:
        yield live


def test_prediction_through_the_openai_client(server, tiny_dir, capsys, tmp_path):
    client = OpenAI(base_url=server.url + "/v1", api_key="unused", timeout=60, max_retries=0)
    messages = [{"role": "user", "content": CHAT}]
    plain = client.chat.completions.create(model="tiny", messages=messages, temperature=0, max_tokens=24)
    answer = plain.choices[0].message.content
    assert plain.usage.completion_tokens_details.accepted_prediction_tokens == 0
    for method in ("ar", "pld"):
        reply = client.chat.completions.create(
            model="tiny", messages=messages, temperature=0, max_tokens=24,
            prediction={"type": "content", "content": answer}, extra_body={"method": method})
        assert reply.choices[0].message.content == answer
        details = reply.usage.completion_tokens_details
        assert details.accepted_prediction_tokens > 12 and details.rejected_prediction_tokens == 0
        assert reply.model_extra["verispec"]["mean_accepted_tokens"] > 3
    with pytest.raises(openai_module.BadRequestError, match="prediction"):
        client.chat.completions.create(model="tiny", messages=messages, max_tokens=4,
                                       prediction={"type": "content", "content": ""})
    # The CLI: --prediction FILE gives the same text and counts
    path = tmp_path / "prediction.txt"
    path.write_text(answer)
    assert main(["generate", "--model", str(tiny_dir), "--method", "ar", "--prompt", CHAT,
                 "--max-new-tokens", "24", "--json", "--prediction", str(path)]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["text"] == answer and out["stats"]["accepted_prediction_tokens"] > 12
