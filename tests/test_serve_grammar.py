"""Structured output through the real openai client: response_format (json_object and
json_schema) and the regex / grammar extra fields give what `verispec.generate` gives under the
same constraint, streamed or not, beside unconstrained requests; bad schemas are a 400 naming
the field; the playground's JSON mode paints forced tokens in Chromium."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import openai as openai_module
import pytest
from openai import OpenAI

import verispec
from tests.serving import LiveServer
from tests.test_serve import playground
from verispec.model.loading import load_model
from verispec.server import create_app

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}
PROMPT = "Give the name and age of Ana, who is 41, as JSON."


@pytest.fixture(scope="module")
def smollm():
    return load_model("smollm2-135m-instruct")


@pytest.fixture(scope="module")
def server(smollm):
    with LiveServer(create_app(smollm, ["pld", "ar"])) as live:
        yield live


def chat(client: OpenAI, prompt: str = PROMPT, **kwargs):
    return client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": prompt}],
                                          temperature=0, max_tokens=40, **kwargs)


def test_response_format_json_schema_through_the_openai_client(server, smollm):
    client = OpenAI(base_url=server.url + "/v1", api_key="unused", timeout=120, max_retries=0)
    expected = verispec.generate(smollm, PROMPT, chat=True, method="pld", json_schema=SCHEMA,
                                 max_new_tokens=40)
    schema_format = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}
    for method in ("pld", "ar"):
        reply = chat(client, response_format=schema_format, extra_body={"method": method})
        assert reply.choices[0].message.content == expected.text, method
        value = json.loads(reply.choices[0].message.content)
        assert set(value) == {"name", "age"} and isinstance(value["age"], int)
        assert reply.choices[0].finish_reason == "stop"
        assert reply.model_extra["verispec"]["forced_tokens"] >= 3
    chunks = list(client.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": PROMPT}], temperature=0, max_tokens=40,
        stream=True, response_format=schema_format))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected.text


def test_json_object_regex_and_grammar_beside_a_free_request(server, smollm):
    """Four requests at once, three constrained three ways and one free: each gets what it gets
    alone."""
    client = OpenAI(base_url=server.url + "/v1", api_key="unused", timeout=120, max_retries=0)
    free = verispec.generate(smollm, PROMPT, chat=True, method="pld", max_new_tokens=40).text
    date = r"[0-9]{4}-[0-9]{2}-[0-9]{2}"
    jobs = {"json_object": {"response_format": {"type": "json_object"}},
            "regex": {"extra_body": {"regex": date}},
            "grammar": {"extra_body": {"grammar": 'start: "yes" | "no"'}},
            "free": {}}
    with ThreadPoolExecutor(len(jobs)) as pool:
        replies = dict(zip(jobs, pool.map(lambda kwargs: chat(client, **kwargs).choices[0].message.content,
                                          jobs.values())))
    assert isinstance(json.loads(replies["json_object"]), dict)
    assert replies["json_object"] == verispec.generate(smollm, PROMPT, chat=True, method="pld",
                                                       json_schema={"type": "object"}, max_new_tokens=40).text
    assert len(replies["regex"]) == 10 and replies["regex"][4] == "-"
    assert replies["grammar"] in {"yes", "no"}
    assert replies["free"] == free


@pytest.mark.parametrize("kwargs, field", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 5}}}},
     "response_format"),
    ({"response_format": {"type": "json_schema"}}, "response_format"),
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"extra_body": {"regex": "a(b"}}, "regex"),
    ({"extra_body": {"grammar": "start: nowhere"}}, "grammar"),
    ({"extra_body": {"regex": "a", "grammar": 'start: "a"'}}, "regex"),
])
def test_bad_constraints_are_a_400_naming_the_field(server, kwargs, field):
    client = OpenAI(base_url=server.url + "/v1", api_key="unused", timeout=60, max_retries=0)
    with pytest.raises(openai_module.BadRequestError) as error:
        chat(client, **kwargs)
    assert error.value.body["param"] == field, error.value.body
    assert chat(client).choices[0].message.content  # the server goes on serving


@pytest.mark.slow  # 15 s on the AVX2 EPYC; tests/test_serve.py's playground test opens Chromium by default
def test_playground_json_modes_in_chromium(server, tmp_path):
    """A schema's keys are forced (painted as such); any JSON object still answers."""
    colours, _, _ = playground(server.url, "pld", PROMPT, 40, tmp_path / "playground-json-schema.png",
                               output="json_schema", schema=SCHEMA)
    assert "tok forced" in {cls for cls, _, _ in colours}
    colours, _, _ = playground(server.url, "pld", PROMPT, 40, tmp_path / "playground-json-object.png",
                               output="json_object")
    assert colours
