"""`dflash serve`'s structured output: OpenAI's response_format and vLLM's structured_outputs (and guided_*),
the answer equal to the engine's constrained one; bad or conflicting constraints are 400s naming the field."""

from __future__ import annotations

import json

import openai
import pytest

from dflash_cli.decoding.constraint import ConstraintSpec
from tests.serving import http, running_server
from tests.test_structured_output import SCHEMA, follows


@pytest.fixture(scope="module")
def url(qwen3_logits_engine):
    with running_server(qwen3_logits_engine) as (url, _):
        yield url


def test_chat_json_schema_answer_is_the_engines_and_valid(url, qwen3_logits_engine):
    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
    messages = [{"role": "user", "content": "a number please"}]
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA, "strict": True}}
    got = client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=48, response_format=fmt, extra_body={"return_token_ids": True}
    )
    engine = qwen3_logits_engine
    want = engine.generate(
        engine.encode_chat(messages, None), max_new_tokens=48, constraint=ConstraintSpec("json_schema", SCHEMA)
    )
    assert got.choices[0].model_extra["token_ids"] == want.tokens
    assert follows(ConstraintSpec("json_schema", SCHEMA), got.choices[0].message.content)
    assert got.choices[0].finish_reason == "stop"


@pytest.mark.parametrize(
    "extra, check",
    [
        ({"structured_outputs": {"choice": ["red", "green"]}}, lambda t: t in ("red", "green")),
        ({"structured_outputs": {"regex": "[0-9]{2}"}}, lambda t: len(t) == 2 and t.isdigit()),
        ({"guided_choice": ["up", "down"]}, lambda t: t in ("up", "down")),
        ({"response_format": {"type": "json_object"}, "max_tokens": 8}, lambda t: t.startswith("{")),
    ],
)
def test_completions_take_vllms_fields_too(url, extra, check):
    body = {"prompt": "x =", "max_tokens": 16, **extra}
    reply = http("POST", url + "/v1/completions", body)
    assert reply.status_code == 200, reply.content
    assert check(reply.json()["choices"][0]["text"])


def test_streamed_constrained_text_is_the_same(url):
    body = {"prompt": "x =", "max_tokens": 16, "structured_outputs": {"regex": "[a-c]{5}"}}
    whole = http("POST", url + "/v1/completions", body).json()["choices"][0]["text"]
    reply = http("POST", url + "/v1/completions", {**body, "stream": True})
    events = [json.loads(line[6:]) for line in reply.content.decode().splitlines() if line.startswith("data: {")]
    assert "".join(e["choices"][0]["text"] for e in events if e.get("choices")) == whole and len(whole) == 5


@pytest.mark.parametrize(
    "body, words",
    [
        ({"response_format": {"type": "xml"}}, "response_format.type"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "schema"),
        ({"structured_outputs": {"regex": "([a-z"}}, "regex cannot be compiled"),
        ({"structured_outputs": {"choice": []}}, "non-empty strings"),
        ({"structured_outputs": {"whitespace": "x"}}, "not supported"),
        ({"response_format": {"type": "json_object"}, "guided_regex": "a+"}, "one output constraint per request"),
    ],
)
def test_constraints_it_cannot_follow_are_400s(url, body, words):
    reply = http("POST", url + "/v1/completions", {"prompt": "x", "max_tokens": 4, **body})
    assert reply.status_code == 400 and words in reply.json()["error"]["message"], reply.content


def test_a_build_without_logits_refuses_a_constraint_with_the_fix(qwen3_engine):
    with running_server(qwen3_engine) as (url, _):
        reply = http("POST", url + "/v1/completions", {"prompt": "x", "guided_regex": "a+"})
    error = reply.json()["error"]
    assert reply.status_code == 400 and "export.logits=true" in error["hint"]


def test_unsatisfiable_unsupported_and_huge_schemas_then_the_server_goes_on(url):
    def ask(schema):
        fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
        return http("POST", url + "/v1/completions", {"prompt": "x", "max_tokens": 8, "response_format": fmt})

    unsat = ask({"type": "string", "minLength": 5, "maxLength": 2})
    assert unsat.status_code == 400 and "Unsatisfiable schema" in unsat.json()["error"]["message"]
    unknown = ask({"not": {}})
    assert unknown.status_code == 400 and "not" in unknown.json()["error"]["message"]
    big = {
        "type": "object",
        "properties": {
            f"k{i}": {"type": "object", "properties": {f"j{j}": {"type": "string"} for j in range(40)}}
            for i in range(200)
        },
    }
    assert ask(big).status_code == 200  # 8,000 properties compile in well under a second
    assert http("POST", url + "/v1/completions", {"prompt": "x", "max_tokens": 3}).status_code == 200


def test_the_openai_clients_parse_with_a_pydantic_model(url):
    """`client.chat.completions.parse`: the client sends the model's strict JSON schema and reads the answer back
    into the model; streamed, the same text."""
    from typing import Literal

    from pydantic import BaseModel, Field

    class Answer(BaseModel):
        n: int = Field(ge=0, le=9)
        ok: bool
        tag: Literal["a", "b"]

    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
    messages = [{"role": "user", "content": "answer"}]
    got = client.chat.completions.parse(model="tiny", messages=messages, response_format=Answer, max_tokens=48)
    parsed = got.choices[0].message.parsed
    assert isinstance(parsed, Answer) and got.choices[0].finish_reason == "stop"
    with client.chat.completions.stream(model="tiny", messages=messages, response_format=Answer, max_tokens=48) as s:
        final = s.get_final_completion()
    assert final.choices[0].message.parsed == parsed
