"""`dflash serve` over HTTP with the official `openai` client: completions and chat, streamed and not,
greedy and seeded tokens equal to `dflash run`, stop strings, usage, bad requests, a full queue,
a client that disconnects mid-stream, and the counters on /metrics."""

from __future__ import annotations

import json
import threading
import time

import openai
import pytest
from typer.testing import CliRunner

from dflash_cli.cli.app import create_app as create_cli
from tests.serving import SlowEngine, http, metric, read_one_event_then_disconnect, running_server

PROMPTS = ["def add(a, b):", "import os\n", "class Stack:", "x = [", "for i in range(10):"]
TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
    "{% if enable_thinking is defined and not enable_thinking %}[no-think]{% endif %}<assistant>"
)


def run_cli(engine, *args) -> dict:
    recipe, cache = str(engine.recipe.source), str(engine.compile_dir.parents[2])
    res = CliRunner().invoke(create_cli(), ["run", "-r", recipe, "--cache-dir", cache, "--json", *args])
    assert res.exit_code == 0, res.output
    return json.loads(res.stdout)


@pytest.fixture(scope="module")
def server(qwen3_engine):
    with running_server(qwen3_engine, queue_size=4) as (url, app):
        yield url, app


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server[0] + "/v1", api_key="unused", max_retries=0, timeout=60)


def test_models_and_health(client, server):
    assert [m.id for m in client.models.list().data] == ["tiny"]
    assert http("GET", server[0] + "/health").json()["status"] == "ok"


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_completion_equals_dflash_run(client, qwen3_engine, prompt):
    want = run_cli(qwen3_engine, "-p", prompt, "--max-new-tokens", "24")
    got = client.completions.create(model="tiny", prompt=prompt, max_tokens=24, extra_body={"return_token_ids": True})
    choice = got.choices[0]
    assert choice.model_extra["token_ids"] == want["token_ids"] and choice.text == want["text"]
    assert got.usage.prompt_tokens == want["prompt_tokens"] and got.usage.completion_tokens == len(want["token_ids"])
    assert got.usage.total_tokens == got.usage.prompt_tokens + got.usage.completion_tokens
    assert choice.finish_reason == ("length" if want["stopped"] == "length" else "stop")
    assert got.model_extra["acceptance_lengths"] == want["acceptance_lengths"]


def test_streamed_completion_is_the_same_text(client):
    whole = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=30)
    pieces, reasons, usage = [], [], None
    stream = client.completions.create(
        model="tiny", prompt=PROMPTS[0], max_tokens=30, stream=True, stream_options={"include_usage": True}
    )
    for event in stream:
        if event.usage:
            usage = event.usage
        for c in event.choices:
            pieces.append(c.text)
            reasons.append(c.finish_reason)
    assert "".join(pieces) == whole.choices[0].text and len([p for p in pieces if p]) > 1
    assert reasons[-1] == whole.choices[0].finish_reason and all(r is None for r in reasons[:-1])
    assert usage.completion_tokens == whole.usage.completion_tokens


def test_stop_strings_cut_text_streamed_or_not(client):
    full = client.completions.create(model="tiny", prompt=PROMPTS[2], max_tokens=40).choices[0].text
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    assert stop.strip(), f"pick another prompt: {full!r}"
    want = full[: full.find(stop)]
    got = client.completions.create(model="tiny", prompt=PROMPTS[2], max_tokens=40, stop=[stop])
    assert got.choices[0].text == want and got.choices[0].finish_reason == "stop"
    assert got.usage.completion_tokens < 40  # generation ended at the stop, not at max_tokens
    stream = client.completions.create(model="tiny", prompt=PROMPTS[2], max_tokens=40, stop=stop, stream=True)
    assert "".join(c.text for e in stream for c in e.choices) == want


def test_ignore_eos_decodes_to_max_tokens(client, qwen3_engine):
    """vLLM's `ignore_eos` (GuideLLM sends it): end-of-sequence ends nothing, the tokens are the same."""
    extra = {"return_token_ids": True}
    full = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=12, extra_body=extra).choices[0]
    assert full.finish_reason == "length", "pick a prompt that runs to max_tokens"
    saved = list(qwen3_engine.eos_token_ids)
    qwen3_engine.eos_token_ids[:] = [full.model_extra["token_ids"][1]]  # the second token now ends a sequence
    try:
        cut = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=12, extra_body=extra).choices[0]
        kept = client.completions.create(
            model="tiny", prompt=PROMPTS[0], max_tokens=12, extra_body={**extra, "ignore_eos": True}
        ).choices[0]
    finally:
        qwen3_engine.eos_token_ids[:] = saved
    assert cut.finish_reason == "stop" and len(cut.model_extra["token_ids"]) < 12
    assert kept.finish_reason == "length" and kept.model_extra["token_ids"] == full.model_extra["token_ids"]


def test_chat_uses_the_template_and_thinking_switch(server, qwen3_engine):
    from dflash_cli.cache.store import Cache
    from dflash_cli.decoding.engine import Engine

    engine = Engine.load(qwen3_engine.recipe, Cache(qwen3_engine.compile_dir.parents[2]))
    engine.tokenizer.chat_template = TEMPLATE
    messages = [{"role": "user", "content": "write a loop"}]
    want = engine.generate(engine.encode_chat(messages, False), max_new_tokens=20)
    with running_server(engine) as (url, _):
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        kw = {"extra_body": {"chat_template_kwargs": {"enable_thinking": False}}}
        got = client.chat.completions.create(model="tiny", messages=messages, max_tokens=20, **kw)
        assert got.choices[0].message.content == engine.decode(want.tokens)
        assert got.choices[0].message.role == "assistant"
        assert got.usage.prompt_tokens == len(engine.encode_chat(messages, False))
        thinking = client.chat.completions.create(
            model="tiny",
            messages=messages,
            max_tokens=2,
            extra_body={"chat_template_kwargs": {"enable_thinking": True}},
        )
        assert thinking.usage.prompt_tokens < got.usage.prompt_tokens  # no "[no-think]" in the prompt
        stream = client.chat.completions.create(model="tiny", messages=messages, max_tokens=20, stream=True, **kw)
        events = list(stream)
        assert events[0].choices[0].delta.role == "assistant"
        assert "".join(e.choices[0].delta.content or "" for e in events) == got.choices[0].message.content
        assert events[-1].choices[0].finish_reason == got.choices[0].finish_reason


def test_chat_without_a_template_joins_contents_like_run(client, qwen3_engine):
    want = run_cli(qwen3_engine, "-p", "def f(x):", "--max-new-tokens", "12")
    got = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "def f(x):"}], max_tokens=12
    )
    assert got.choices[0].message.content == want["text"]


@pytest.mark.parametrize(
    "kwargs, needle",
    [
        ({"model": "gpt-4", "prompt": "x"}, "not served here"),
        ({"model": "tiny", "prompt": "x " * 400}, "exceeds the"),
        ({"model": "tiny", "prompt": "x", "max_tokens": -3}, "max_tokens"),
        ({"model": "tiny", "prompt": "x", "temperature": 0.8}, "export.logits=true"),
        ({"model": "tiny", "prompt": "x", "n": 2}, "n=1"),
        ({"model": "tiny", "prompt": "   "}, "the prompt is empty"),
    ],
)
def test_bad_requests_are_400_with_an_openai_error_body(client, server, kwargs, needle):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(**kwargs)
    err = info.value.body
    assert needle in err["message"] + " hint: " + (err.get("hint") or "") and err["type"] == "invalid_request_error"
    assert http("GET", server[0] + "/health").status_code == 200  # the server lives on


def test_invalid_json_and_unknown_route(server):
    res = http("POST", server[0] + "/v1/completions", raw=b"{not json")
    assert res.status_code == 400 and "not valid JSON" in res.json()["error"]["message"]
    res = http("POST", server[0] + "/v1/embeddings", {})
    assert res.status_code == 404 and "error" in res.json()


def test_metrics_count_what_the_responses_report(qwen3_engine):
    with running_server(qwen3_engine) as (url, _):
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        accepts, tokens = [], 0
        for p in PROMPTS[:3]:
            r = client.completions.create(model="tiny", prompt=p, max_tokens=20)
            accepts += r.model_extra["acceptance_lengths"]
            tokens += r.usage.completion_tokens
        text = http("GET", url + "/metrics").text
    block = qwen3_engine.block_size
    assert metric(text, "vllm:spec_decode_num_drafts_total") == len(accepts)
    assert metric(text, "vllm:spec_decode_num_draft_tokens_total") == len(accepts) * (block - 1)
    assert metric(text, "vllm:spec_decode_num_accepted_tokens_total") == sum(a - 1 for a in accepts)
    per_pos = [metric(text, "vllm:spec_decode_num_accepted_tokens_per_pos_total", position=str(i)) for i in range(3)]
    assert per_pos == [sum(a - 1 > i for a in accepts) for i in range(block - 1)]
    assert metric(text, "vllm:generation_tokens_total") == tokens
    assert sum(metric(text, "vllm:request_success_total", finished_reason=r) for r in ("stop", "length")) == 3


def test_full_queue_answers_503_with_retry_after(qwen3_engine):
    slow = SlowEngine(qwen3_engine)
    slow.gate.clear()
    with running_server(slow, queue_size=1) as (url, _):
        body = {"model": "tiny", "prompt": "x = 1", "max_tokens": 4}
        post = lambda: http("POST", url + "/v1/completions", body)  # noqa: E731
        held = [threading.Thread(target=post)]
        held[0].start()
        assert slow.started.wait(10)  # one running (held at the gate) ...
        held.append(threading.Thread(target=post))
        held[1].start()
        deadline = time.monotonic() + 10
        while http("GET", url + "/health").json()["waiting"] < 1 and time.monotonic() < deadline:
            time.sleep(0.02)  # ... and one waiting
        res = http("POST", url + "/v1/completions", body)
        assert res.status_code == 503 and res.headers["retry-after"] == "1"
        assert "busy" in res.json()["error"]["message"]
        slow.gate.set()
        for t in held:
            t.join(30)
        assert len(slow.results) == 2  # both admitted requests completed
        assert metric(http("GET", url + "/metrics").text, "dflash:requests_rejected_total") == 1


def test_disconnect_mid_stream_frees_the_engine(qwen3_engine):
    slow = SlowEngine(qwen3_engine, pause=0.05)
    with running_server(slow) as (url, _):
        body = {"model": "tiny", "prompt": "def add(a, b):", "max_tokens": 100, "stream": True}
        read_one_event_then_disconnect(url + "/v1/completions", body)
        result = slow.first_result()
        assert result is not None and result.stopped == "cancelled" and result.new_tokens < 100
        text = http("GET", url + "/metrics").text
        assert metric(text, "vllm:request_success_total", finished_reason="abort") == 1
        slow.pause = 0.0
        done = http("POST", url + "/v1/completions", {**body, "stream": False, "max_tokens": 5})
        assert done.status_code == 200 and done.json()["usage"]["completion_tokens"] >= 1


@pytest.fixture(scope="module")
def logits_engine(qwen3_logits_engine):
    return qwen3_logits_engine


def test_seeded_sampling_equals_dflash_run(logits_engine):
    with running_server(logits_engine) as (url, _):
        client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0)
        for seed in (1, 7):
            want = run_cli(
                logits_engine, "-p", "def f(x):", "--max-new-tokens", "16", "--temperature", "0.8", "--seed", str(seed)
            )
            got = client.completions.create(
                model="tiny",
                prompt="def f(x):",
                max_tokens=16,
                temperature=0.8,
                seed=seed,
                extra_body={"return_token_ids": True},
            )
            assert got.choices[0].model_extra["token_ids"] == want["token_ids"]
