"""`dflash serve`'s tool calling: tools rendered by the target's chat template, calls parsed into tool_calls
(streamed too), `tool_choice` required / named constraining the answer to valid calls in every mode."""

from __future__ import annotations

import json

import openai
import pytest

from tests.serving import http, running_server

TEMPLATE = (
    "{% if tools %}<tools>{% for t in tools %}{{ t['function']['name'] }} {% endfor %}</tools>\n{% endif %}"
    "{% for m in messages %}<{{ m['role'] }}>{% if m.get('tool_calls') %}{% for c in m['tool_calls'] %}"
    "<tool_call>{{ c['function'] | tojson }}</tool_call>{% endfor %}{% else %}{{ m['content'] }}{% endif %}\n"
    "{% endfor %}<assistant>"
)
ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "Add two small numbers",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}, "b": {"enum": [1, 2]}},
            "required": ["a", "b"],
            "additionalProperties": False,
        },
    },
}
CITY = {
    "type": "function",
    "function": {
        "name": "city",
        "parameters": {
            "type": "object",
            "properties": {"name": {"enum": ["Oslo", "Rome"]}},
            "required": ["name"],
            "additionalProperties": False,
        },
    },
}
MESSAGES = [{"role": "user", "content": "what is 2 + 1?"}]
TOOLS = {"messages": MESSAGES, "tools": [ADD]}


@pytest.fixture(scope="module")
def engine(tiny_qwen3_pair, tmp_path_factory):
    """The tiny pair with logits and room for calls (ctx 512), with a template that renders tools."""
    from tests.engines import open_engine

    e = open_engine(tiny_qwen3_pair, tmp_path_factory.mktemp("tools"), export={"logits": True, "ctx_len": 512})
    e.tokenizer.chat_template = TEMPLATE
    return e


@pytest.fixture(scope="module")
def client(engine):
    with running_server(engine) as (url, _):
        yield openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0), url


def valid_call(call) -> bool:
    args = json.loads(call.function.arguments)
    if call.function.name == "add":
        return set(args) == {"a", "b"} and 0 <= args["a"] <= 9 and args["b"] in (1, 2)
    return call.function.name == "city" and args["name"] in ("Oslo", "Rome")


def test_a_required_call_is_valid_and_what_constrained_plain_decoding_writes(client, engine):
    from dflash_cli.serve.tools import ToolRequest, parse_calls

    c, _ = client
    got = c.chat.completions.create(
        model="tiny", messages=MESSAGES, tools=[ADD, CITY], tool_choice="required", max_tokens=96
    )
    choice = got.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert choice.message.tool_calls and all(valid_call(t) for t in choice.message.tool_calls)
    ids = engine.encode_chat(MESSAGES, None, [ADD, CITY])
    spec = ToolRequest([ADD, CITY], "required").constraint()
    for mode in ("plain", "dflash", "lookup", "hybrid"):
        want = parse_calls(engine.decode(engine.generate(ids, mode=mode, max_new_tokens=96, constraint=spec).tokens))
        assert [(w["function"]["name"], json.loads(w["function"]["arguments"])) for w in want.calls] == [
            (t.function.name, json.loads(t.function.arguments)) for t in choice.message.tool_calls
        ], mode


def test_a_named_function_without_parallel_calls_is_called_once(client):
    c, _ = client
    named = {"type": "function", "function": {"name": "city"}}
    got = c.chat.completions.create(
        model="tiny", messages=MESSAGES, tools=[ADD, CITY], tool_choice=named, parallel_tool_calls=False, max_tokens=64
    )
    calls = got.choices[0].message.tool_calls
    assert len(calls) == 1 and calls[0].function.name == "city" and valid_call(calls[0])


def test_streamed_calls_arrive_as_tool_call_deltas(client):
    c, _ = client
    kw = dict(model="tiny", messages=MESSAGES, tools=[ADD], tool_choice="required", max_tokens=64)
    whole = c.chat.completions.create(**kw).choices[0].message.tool_calls
    events = list(c.chat.completions.create(**kw, stream=True))
    deltas = [d for e in events if e.choices and e.choices[0].delta.tool_calls for d in e.choices[0].delta.tool_calls]
    assert [(d.function.name, d.function.arguments) for d in deltas] == [
        (t.function.name, t.function.arguments) for t in whole
    ]
    assert events[-1].choices[0].finish_reason == "tool_calls"
    assert not "".join(e.choices[0].delta.content or "" for e in events if e.choices)


def test_auto_renders_the_tools_and_none_does_not(client):
    c, _ = client
    bare = c.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=4)
    auto = c.chat.completions.create(model="tiny", messages=MESSAGES, tools=[ADD], max_tokens=4)
    none = c.chat.completions.create(model="tiny", messages=MESSAGES, tools=[ADD], tool_choice="none", max_tokens=4)
    assert auto.usage.prompt_tokens > bare.usage.prompt_tokens == none.usage.prompt_tokens
    assert auto.choices[0].finish_reason != "tool_calls" or auto.choices[0].message.tool_calls


def test_a_conversation_with_earlier_calls_and_their_results(client):
    c, _ = client
    call = {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 1}'}}
    messages = [
        *MESSAGES,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "3"},
    ]
    got = c.chat.completions.create(model="tiny", messages=messages, tools=[ADD], max_tokens=4)
    assert got.choices[0].message.role == "assistant"


@pytest.mark.parametrize(
    "path, body, words",
    [
        ("/v1/completions", {"prompt": "x", "tools": [ADD]}, "'tools' is not supported"),
        ("/v1/chat/completions", {"messages": MESSAGES, "tool_choice": "required"}, "needs 'tools'"),
        (
            "/v1/chat/completions",
            {"messages": MESSAGES, "tools": [ADD], "tool_choice": {"type": "function", "function": {"name": "sub"}}},
            "not among the tools",
        ),
        (
            "/v1/chat/completions",
            {
                "messages": MESSAGES,
                "tools": [ADD],
                "tool_choice": "required",
                "response_format": {"type": "json_object"},
            },
            "cannot both apply",
        ),
        ("/v1/chat/completions", {"messages": MESSAGES, "tools": [{"type": "function"}]}, "tools[0]"),
    ],
)
def test_tool_requests_it_cannot_answer_are_400s(client, path, body, words):
    _, url = client
    reply = http("POST", url + path, {"max_tokens": 4, **body})
    assert reply.status_code == 400 and words in reply.json()["error"]["message"], reply.content


def test_a_template_without_tools_and_a_family_without_a_call_format_are_refused(qwen3_logits_engine, engine):
    from types import SimpleNamespace

    from dflash_cli.serve.intake import _tools_for
    from dflash_cli.serve.protocol import ApiError
    from dflash_cli.serve.tools import ToolRequest

    with running_server(qwen3_logits_engine) as (url, _):  # the tiny tokenizer has no chat template
        reply = http("POST", url + "/v1/chat/completions", {"messages": MESSAGES, "tools": [ADD], "max_tokens": 2})
    assert reply.status_code == 400 and "does not render tools" in reply.json()["error"]["message"]
    llama = SimpleNamespace(settings=SimpleNamespace(family="llama"))
    with pytest.raises(ApiError, match="not supported for llama"):
        _tools_for(llama, SimpleNamespace(tools=ToolRequest([ADD], "auto")))


def test_calls_are_parsed_out_of_the_text_and_bad_ones_stay_text():
    from dflash_cli.serve.tools import parse_calls

    call = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
    text = f'ok {call}\n<tool_call>{{"name": 3}}</tool_call>'
    parsed = parse_calls(text)
    assert [c["function"]["name"] for c in parsed.calls] == ["add"] and parsed.content.startswith("ok")
    assert '<tool_call>{"name": 3}</tool_call>' in parsed.content
    assert parse_calls(f'{call}\n<tool_call>\n{{"name": "ad').content == ""  # cut off by max_tokens
    assert parse_calls("no calls here").calls == [] and parse_calls("<tool_call>x</tool_call>").calls == []


@pytest.mark.parametrize("stream", [False, True])
def test_a_tool_call_round_trip_with_the_openai_client(client, stream):
    """Ask, get a call, run it, send its result back, get an answer: as an application does."""
    c, _ = client
    messages = list(MESSAGES)
    kw = dict(model="tiny", tools=[ADD], max_tokens=96)
    if stream:
        calls: dict[int, dict] = {}
        for event in c.chat.completions.create(messages=messages, tool_choice="required", stream=True, **kw):
            for d in (event.choices[0].delta.tool_calls or []) if event.choices else []:
                calls[d.index] = {
                    "id": d.id,
                    "type": "function",
                    "function": {"name": d.function.name, "arguments": d.function.arguments},
                }
        tool_calls = [calls[i] for i in sorted(calls)]
    else:
        reply = c.chat.completions.create(messages=messages, tool_choice="required", **kw)
        tool_calls = [t.model_dump() for t in reply.choices[0].message.tool_calls]
    assert tool_calls and all(t["function"]["name"] == "add" for t in tool_calls)
    messages.append({"role": "assistant", "content": None, "tool_calls": tool_calls})
    for t in tool_calls:
        args = json.loads(t["function"]["arguments"])
        messages.append({"role": "tool", "tool_call_id": t["id"], "content": str(args["a"] + args["b"])})
    answer = c.chat.completions.create(messages=messages, tool_choice="none", **kw)
    assert answer.choices[0].message.role == "assistant" and answer.choices[0].finish_reason in ("stop", "length")
    assert answer.usage.prompt_tokens > len(MESSAGES[0]["content"]) // 4


def test_qwen3_xml_calls_are_parsed_with_their_schemas_types():
    from dflash_cli.serve.tools import parse_calls

    text = (
        "let me add\n<tool_call>\n<function=add>\n<parameter=a>\n7\n</parameter>\n<parameter=b>\n2\n</parameter>\n"
        "</function>\n</tool_call>\n<tool_call>\n<function=city>\n<parameter=name>\nRome\n</parameter>\n</function>\n"
        "</tool_call>"
    )
    parsed = parse_calls(text, "qwen3_xml", [ADD, CITY])
    assert parsed.content == "let me add"
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in parsed.calls] == [
        ("add", {"a": 7, "b": 2}),
        ("city", {"name": "Rome"}),
    ]


@pytest.mark.parametrize("choice", ["required", "city"])
def test_a_required_qwen3_xml_call_equals_plain_in_every_mode_and_validates(engine, choice):
    """Qwen3.5 / 3.6 / Qwen3-Next's format, constrained on the tiny pair (the grammar does not depend on the
    model): every mode writes the same calls, and their arguments follow the tools' schemas."""
    import jsonschema

    from dflash_cli.serve.tools import ToolRequest, parse_calls

    ids = engine.encode_chat(MESSAGES, None, [ADD, CITY])
    spec = ToolRequest([ADD, CITY], choice, parallel=False, fmt="qwen3_xml").constraint()
    runs = {
        m: engine.generate(ids, mode=m, max_new_tokens=96, constraint=spec).tokens
        for m in ("plain", "dflash", "lookup", "hybrid")
    }
    assert all(r == runs["plain"] for r in runs.values())
    text = engine.decode([t for t in runs["plain"] if t not in engine.eos_token_ids])
    calls = parse_calls(text, "qwen3_xml", [ADD, CITY]).calls
    assert len(calls) == 1 and (choice == "required" or calls[0]["function"]["name"] == choice), text
    tool = next(t for t in (ADD, CITY) if t["function"]["name"] == calls[0]["function"]["name"])
    jsonschema.validate(json.loads(calls[0]["function"]["arguments"]), tool["function"]["parameters"])


def test_a_qwen3_5_target_gets_its_own_call_format():
    from types import SimpleNamespace

    from dflash_cli.serve.intake import _tools_for
    from dflash_cli.serve.tools import ToolRequest

    req = SimpleNamespace(tools=ToolRequest([ADD], "required"), constraint=None)
    assert _tools_for(SimpleNamespace(settings=SimpleNamespace(family="qwen3_5")), req) == [ADD]
    assert req.tools.fmt == "qwen3_xml" and "<function=add>" in req.constraint.value


def test_tools_beside_images_are_refused_not_dropped():
    from types import SimpleNamespace

    from dflash_cli.serve.intake import _encode
    from dflash_cli.serve.protocol import ApiError
    from dflash_cli.serve.tools import ToolRequest

    image = [{"type": "image", "url": "file:///x.png", "where": "messages[0].content[0]"}]
    req = SimpleNamespace(kind="chat", prompt=[{"role": "user", "content": image}], tools=ToolRequest([ADD], "auto"))
    with pytest.raises(ApiError, match="tools with images"):
        _encode(SimpleNamespace(), req)
