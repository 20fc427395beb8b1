"""How a family's models write tool calls: the grammar of a required call, and the calls read back out of text.

Both formats put each call between <tool_call> and </tool_call>:
* "hermes" (Qwen3, Qwen3-MoE, Qwen3-VL): a JSON object {"name": ..., "arguments": {...}}.
* "qwen3_xml" (Qwen3.5, Qwen3.6, Qwen3-Next / Qwen3-Coder-Next): <function=NAME>, then per argument
  <parameter=KEY>, its value on the lines after (a string as it is, anything else as JSON), </parameter>,
  then </function>.
"""

from __future__ import annotations

import json
import re
from typing import Any

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(re.escape(OPEN) + r"(.*?)" + re.escape(CLOSE), re.DOTALL)
_FUNCTION = re.compile(r"\s*<function=([^>\n]+)>(.*?)</function>\s*", re.DOTALL)
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>", re.DOTALL)
_COMPACT = {"x-guidance": {"whitespace_flexible": False}}  # as response_format's JSON (decoding/constraint.py)
FORMATS = ("hermes", "qwen3_xml")


def _lit(text: str) -> str:
    return json.dumps(text)  # a Lark string literal (JSON's escapes)


def call_grammar(fmt: str, functions: list[dict], parallel: bool) -> str:
    """The Lark grammar (llguidance's dialect) of one or more calls (one without `parallel`) of `functions`."""
    if fmt == "hermes":
        calls = [
            {
                "type": "object",
                "properties": {"name": {"const": f["name"]}, "arguments": f.get("parameters") or {"type": "object"}},
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
            for f in functions
        ]
        schema = json.dumps({**_COMPACT, **calls[0]} if len(calls) == 1 else {**_COMPACT, "anyOf": calls})
        rules = [f"call: {_lit(OPEN + chr(10))} %json {schema} {_lit(chr(10) + CLOSE)}"]
    else:
        rules = [f"call: {_lit(OPEN + chr(10))} fn {_lit(chr(10) + CLOSE)}"]
        rules.append("fn: " + " | ".join(f"fn{i}" for i in range(len(functions))))
        for i, f in enumerate(functions):
            rules += _xml_function(i, f)
    start = f"start: call ({_lit(chr(10))} call)*" if parallel else "start: call"
    return "\n".join([start, *rules]) + "\n"


def _xml_function(i: int, f: dict) -> list[str]:
    """fn{i}: the function's required parameters in its schema's order, then each optional one or not."""
    params = f.get("parameters") or {}
    props: dict = params.get("properties") or {}
    required = set(params.get("required") or [])
    parts, rules = [], []
    for j, (key, schema) in enumerate(props.items()):
        value = r"/[^<]*/" if schema.get("type") == "string" else f"%json {json.dumps({**_COMPACT, **schema})}"
        rules.append(
            f"p{i}_{j}: {_lit(f'<parameter={key}>' + chr(10))} {value} {_lit(chr(10) + '</parameter>' + chr(10))}"
        )
        parts.append(f"p{i}_{j}" if key in required else f"p{i}_{j}?")
    head = _lit(f"<function={f['name']}>" + "\n")
    return [f"fn{i}: {head} {' '.join(parts)} {_lit('</function>')}", *rules]


def read_calls(fmt: str, text: str, tools: list[dict]) -> tuple[list[tuple[str, dict]], list[tuple[int, int]]]:
    """The calls in `text` as (name, arguments) and the spans they cover; a block that is not a call is left."""
    found, spans = [], []
    for m in _BLOCK.finditer(text):
        call = _hermes(m.group(1)) if fmt == "hermes" else _xml(m.group(1), tools)
        if call is not None:
            found.append(call)
            spans.append(m.span())
    return found, spans


def _hermes(body: str) -> tuple[str, dict] | None:
    try:
        doc = json.loads(body)
    except ValueError:
        return None
    ok = isinstance(doc, dict) and isinstance(doc.get("name"), str) and isinstance(doc.get("arguments"), dict)
    return (doc["name"], doc["arguments"]) if ok else None


def _xml(body: str, tools: list[dict]) -> tuple[str, dict] | None:
    m = _FUNCTION.fullmatch(body)
    if m is None:
        return None
    name = m.group(1).strip()
    schema = next((t["function"].get("parameters") or {} for t in tools if t["function"]["name"] == name), {})
    props = schema.get("properties") or {}
    args = {k.strip(): _value(v, props.get(k.strip(), {})) for k, v in _PARAMETER.findall(m.group(2))}
    return name, args


def _value(text: str, schema: dict) -> Any:
    """A parameter's text as its schema's type: a string as written, anything else read as JSON where it is."""
    if schema.get("type") == "string":
        return text
    try:
        return json.loads(text)
    except ValueError:
        return text
