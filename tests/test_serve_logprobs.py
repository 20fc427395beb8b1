"""`dflash serve`'s logprobs: completions (`logprobs`, `echo`: what lm-evaluation-harness' loglikelihood asks)
and chat (`logprobs`, `top_logprobs`), equal to the engine's, and the refusals."""

from __future__ import annotations

import pytest

from tests.serving import http, running_server


@pytest.fixture(scope="module")
def url(qwen3_logits_engine):
    with running_server(qwen3_logits_engine) as (url, _):
        yield url


def test_completion_logprobs_are_the_engines(url, qwen3_logits_engine):
    engine = qwen3_logits_engine
    body = {"prompt": "def add(a, b):", "max_tokens": 12, "logprobs": 2, "return_token_ids": True}
    choice = http("POST", url + "/v1/completions", body).json()["choices"][0]
    want = engine.generate(engine.encode_prompt(body["prompt"]), max_new_tokens=12, logprobs=2)
    got = choice["logprobs"]
    assert choice["token_ids"] == want.tokens and got["token_logprobs"] == [e.logprob for e in want.logprobs]
    assert got["tokens"] == [engine.decode([t]) for t in want.tokens]
    for top, e in zip(got["top_logprobs"], want.logprobs):
        likeliest = {}
        for t, lp in e.top:
            likeliest.setdefault(engine.decode([t]), lp)
        assert top == likeliest and list(top.values())[0] == e.logprob  # greedy: the likeliest first
    assert got["text_offset"][0] == 0 and got["text_offset"] == sorted(got["text_offset"])


def test_echo_with_logprobs_scores_a_token_id_prompt(url, qwen3_logits_engine):
    """lm-evaluation-harness' loglikelihood request: token ids, max_tokens 1, echo, logprobs 1."""
    engine = qwen3_logits_engine
    prompt = [11, 12, 13, 14, 15, 16, 17, 18]
    body = {"prompt": prompt, "max_tokens": 1, "logprobs": 1, "echo": True, "temperature": 0}
    choice = http("POST", url + "/v1/completions", body).json()["choices"][0]
    want = engine.generate(prompt, max_new_tokens=1, logprobs=1, prompt_logprobs=True)
    got = choice["logprobs"]
    assert len(got["tokens"]) == len(prompt) + 1 and got["token_logprobs"][0] is None and got["top_logprobs"][0] is None
    assert got["token_logprobs"][1:] == [e.logprob for e in want.prompt_logprobs[1:] + want.logprobs]
    assert choice["text"] == engine.decode(prompt) + engine.decode(want.tokens)


def test_echo_alone_streams_the_prompt_first(url):
    reply = http("POST", url + "/v1/completions", {"prompt": "x = 1", "max_tokens": 4, "echo": True, "stream": True})
    import json

    events = [line[6:] for line in reply.content.decode().splitlines() if line.startswith("data: ")]
    text = "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1] if json.loads(e).get("choices"))
    assert reply.status_code == 200 and text.startswith("x = 1") and len(text) > len("x = 1")


def test_chat_logprobs_in_openai_shape(url, qwen3_logits_engine):
    import openai

    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
    got = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "hello"}],
        max_tokens=6,
        logprobs=True,
        top_logprobs=3,
        extra_body={"return_token_ids": True},
    )
    choice = got.choices[0]
    content = choice.logprobs.content
    assert [c.token for c in content] == [qwen3_logits_engine.decode([t]) for t in choice.model_extra["token_ids"]]
    assert all(len(c.top_logprobs) == 3 and c.bytes == list(c.token.encode()) for c in content)
    assert all(c.top_logprobs[0].logprob == c.logprob for c in content)  # greedy: the likeliest


@pytest.mark.parametrize(
    "path, body, words",
    [
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "needs"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "echo": True}, "echo"),
        ("/v1/completions", {"prompt": "x", "logprobs": 2, "stream": True, "echo": True}, "not streamed"),
    ],
)
def test_logprob_requests_it_cannot_answer_are_400s(url, path, body, words):
    reply = http("POST", url + path, body)
    assert reply.status_code == 400 and words in reply.json()["error"]["message"]


def test_a_build_without_logits_refuses_logprobs_with_the_fix(qwen3_engine):
    with running_server(qwen3_engine) as (url, _):
        reply = http("POST", url + "/v1/completions", {"prompt": "x", "logprobs": 1})
    error = reply.json()["error"]
    assert reply.status_code == 400 and "logits" in error["message"] and "export.logits=true" in error["hint"]


def test_streamed_logprobs_are_the_whole_answers_in_order(url):
    import json

    body = {"prompt": "def add(a, b):", "max_tokens": 16, "logprobs": 2, "stop": ["\n\n\n"]}
    whole = http("POST", url + "/v1/completions", body).json()["choices"][0]["logprobs"]
    reply = http("POST", url + "/v1/completions", {**body, "stream": True})
    chunks = [json.loads(line[6:]) for line in reply.content.decode().splitlines() if line.startswith("data: {")]
    parts = [c["choices"][0]["logprobs"] for c in chunks if c.get("choices") and c["choices"][0]["logprobs"]]
    joined = {k: [v for p in parts for v in p[k]] for k in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}
    assert len(parts) >= 2 and joined == whole


def test_streamed_chat_logprobs_are_the_whole_answers(url):
    import openai

    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
    kw = dict(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=10, logprobs=True, top_logprobs=2)
    whole = client.chat.completions.create(**kw).choices[0].logprobs.content
    streamed = [
        item
        for c in client.chat.completions.create(**kw, stream=True)
        if c.choices and c.choices[0].logprobs
        for item in c.choices[0].logprobs.content
    ]
    assert [(i.token, i.logprob) for i in streamed] == [(i.token, i.logprob) for i in whole] and whole
