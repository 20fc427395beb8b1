"""Tool calling: a chat request's `tools`, `tool_choice` and `parallel_tool_calls`, the grammar that makes a call
required, and the model's calls parsed out of its text into OpenAI's `tool_calls`.

The target's own chat template renders the tools; the calls come back in its family's format (Family
`tool_call_format`, serve/tool_formats.py). `tool_choice` "required" or a named function constrains the answer to
calls (of that function) whose arguments follow the tool's JSON schema (decoding/constraint.py), so every mode
gives what constrained plain decoding gives; "auto" lets the model choose and parses what it wrote; "none"
renders no tools.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

from dflash_cli.decoding.constraint import ConstraintSpec
from dflash_cli.serve.tool_formats import CLOSE, OPEN, call_grammar, read_calls


@dataclass(frozen=True)
class ToolRequest:
    tools: list[dict]  # OpenAI's [{"type": "function", "function": {name, description, parameters}}]
    choice: str  # "auto" | "required" | a function's name
    parallel: bool = True
    fmt: str = "hermes"  # how the family writes calls (serve/tool_formats.py), set once the target is known

    @property
    def names(self) -> list[str]:
        return [t["function"]["name"] for t in self.tools]

    def constraint(self) -> ConstraintSpec | None:
        """The grammar of a required call (any tool, or the named one) in this family's format; None for "auto"."""
        if self.choice == "auto":
            return None
        picked = [t["function"] for t in self.tools if self.choice in ("required", t["function"]["name"])]
        return ConstraintSpec("grammar", call_grammar(self.fmt, picked, self.parallel))


@dataclass
class ParsedCalls:
    content: str  # the text outside the calls
    calls: list[dict] = field(default_factory=list)  # OpenAI's tool_calls


def read_tools(body: dict[str, Any], error: type[Exception]) -> ToolRequest | None:
    """The request's tools, or None (no tools, or tool_choice "none"); `error(message, param=...)` for bad ones."""
    tools = body.get("tools")
    choice = body.get("tool_choice")
    if tools is None:
        if choice not in (None, "none"):
            raise error("'tool_choice' needs 'tools'", param="tool_choice")
        return None
    if not isinstance(tools, list) or not tools:
        raise error("'tools' must be a non-empty list of function tools", param="tools")
    for i, t in enumerate(tools):
        f = t.get("function") if isinstance(t, dict) and t.get("type") == "function" else None
        if not isinstance(f, dict) or not isinstance(f.get("name"), str) or not f["name"]:
            raise error(f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ...}}}}", param="tools")
        if f.get("parameters") is not None and not isinstance(f["parameters"], dict):
            raise error(f"tools[{i}].function.parameters must be a JSON schema object", param="tools")
    names = [t["function"]["name"] for t in tools]
    if choice in (None, "auto", "required", "none"):
        picked = choice or "auto"
    elif isinstance(choice, dict) and isinstance((choice.get("function") or {}).get("name"), str):
        picked = choice["function"]["name"]
        if picked not in names:
            raise error(f"tool_choice names {picked!r}, which is not among the tools", param="tool_choice")
    else:
        raise error("'tool_choice' must be 'none', 'auto', 'required' or a named function", param="tool_choice")
    parallel = body.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool):
        raise error("'parallel_tool_calls' must be true or false", param="parallel_tool_calls")
    return None if picked == "none" else ToolRequest(tools, picked, parallel)


def parse_calls(text: str, fmt: str = "hermes", tools: list[dict] | None = None) -> ParsedCalls:
    """The calls out of `text` (serve/tool_formats.py): a block that is not a call stays in the content, as the
    model wrote it; a call cut off by max_tokens is dropped."""
    found, spans = read_calls(fmt, text, tools or [])
    calls, kept, at = [], [], 0
    for (name, args), (start, end) in zip(found, spans):
        kept.append(text[at:start])
        at = end
        function = {"name": name, "arguments": json.dumps(args, ensure_ascii=False)}
        calls.append({"id": "call_" + uuid.uuid4().hex[:24], "type": "function", "function": function})
    rest = text[at:]
    if calls and rest.rfind(OPEN) > rest.rfind(CLOSE):
        rest = rest[: rest.rfind(OPEN)]
    kept.append(rest)
    return ParsedCalls("".join(kept).strip() if calls else text, calls)


def cut(text: str, stops: list[str]) -> str:
    """`text` up to its first stop string."""
    at = min((i for i in (text.find(s) for s in stops if s) if i >= 0), default=-1)
    return text if at < 0 else text[:at]


def held_at_call(decode, stream) -> bool:
    """Whether a TextStream given the call marker as a stop string stopped at the marker (the answer goes on)
    rather than at one of the request's own stop strings."""
    return decode(stream.tokens)[len(stream.text) :].startswith(OPEN)
