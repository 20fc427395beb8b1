"""OpenAI-compatible request parsing and response bodies (completions and chat completions).

Parsing is by hand rather than by a schema so every refusal is one OpenAI-style error with the
same wording the CLI uses. Unknown fields that clients routinely send (`user`, `metadata`, ...) are ignored;
a known field that would change the answer and that dflash does not apply is refused unless it has its
neutral value.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from dflash_cli.decoding.constraint import ConstraintSpec
from dflash_cli.decoding.logprobs import MAX_TOP
from dflash_cli.errors import DFlashError
from dflash_cli.serve.structured import read_constraint
from dflash_cli.serve.tools import ToolRequest, read_tools


class ApiError(Exception):
    """An error answered as `{"error": {...}}` with an HTTP status (400 unless said otherwise)."""

    def __init__(
        self,
        message: str,
        *,
        status: int = 400,
        param: str | None = None,
        code: str | None = None,
        hint: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message, self.status, self.param, self.code, self.hint = message, status, param, code, hint
        self.headers = headers or {}

    @classmethod
    def from_dflash(cls, exc: DFlashError, status: int = 400) -> ApiError:
        return cls(exc.message, status=status, hint=exc.hint)

    def body(self) -> dict[str, Any]:
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        err: dict[str, Any] = {"message": self.message, "type": kind, "param": self.param, "code": self.code}
        if self.hint:
            err["hint"] = self.hint  # extension: what the CLI prints as `hint:`
        return {"error": err}


@dataclass
class GenRequest:
    kind: str  # "completion" | "chat"
    model: str
    prompt: str | list[dict] | list[int]  # text, chat messages, or token ids
    max_tokens: int
    temperature: float
    top_k: int
    top_p: float
    seed: int
    stop: list[str]
    repetition_penalty: float = 1.0  # vLLM's extension (decoding/penalty.py): needs a build with logits
    stream: bool = False
    include_usage: bool = False
    enable_thinking: bool | None = None  # chat only; None = the recipe's run.enable_thinking
    max_tokens_given: bool = True  # False: the recipe's default, which the server caps to the room left
    return_token_ids: bool = False  # extension (vLLM has it too): the completion's token ids in the choice
    ignore_eos: bool = False  # extension (vLLM's): decode past end-of-sequence to max_tokens, as load clients ask
    logprobs: int | None = None  # each new token's logprob and this many alternatives (None: not asked)
    echo: bool = False  # completions: the prompt precedes the text (and its tokens the logprobs)
    constraint: ConstraintSpec | None = None  # a grammar the answer follows (serve/structured.py, serve/tools.py)
    tools: ToolRequest | None = None  # chat: the function tools the model may (or must) call
    images: Any = None  # a chat's images as the target takes them (vision_feeds.ImagePrompt), set at intake
    id: str = field(default_factory=lambda: uuid.uuid4().hex[:24])
    created: int = field(default_factory=lambda: int(time.time()))


def parse_request(body: Any, kind: str, model_name: str, defaults: Any) -> GenRequest:
    """Validate one request body; `defaults` is the recipe's run section (what `dflash run` uses)."""
    if not isinstance(body, dict):
        raise ApiError("the request body must be a JSON object", code="invalid_json")
    _refuse_lone_surrogates(body)
    model = body.get("model", model_name)
    if model != model_name:
        raise ApiError(
            f"model {model!r} is not served here",
            param="model",
            code="model_not_found",
            hint=f"this server serves {model_name!r} (GET /v1/models)",
        )
    if kind == "chat":
        prompt: Any = _messages(body.get("messages"))
        max_key = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    else:
        prompt = _prompt(body.get("prompt"))
        max_key = "max_tokens"
    n = body.get("n", 1)
    if n not in (1, None):
        raise ApiError("only n=1 is supported", param="n", hint="send one request per completion")
    unsupported = [k for k in ("suffix", "functions") + (("echo",) if kind == "chat" else ("tools",)) if body.get(k)]
    unsupported += ["best_of"] if body.get("best_of") not in (None, 1) else []
    # Fields that would change the answer, at any value but their neutral one: refused, never ignored
    unsupported += [k for k, neutral in _NEUTRAL.items() if body.get(k) not in (None, *neutral)]
    if unsupported:
        raise ApiError(
            f"{unsupported[0]!r} is not supported by dflash serve", param=unsupported[0], hint="leave the field out"
        )
    stream_options = body.get("stream_options") or {}
    kwargs = body.get("chat_template_kwargs") or {}
    if not isinstance(kwargs, dict) or not isinstance(stream_options, dict):
        raise ApiError("chat_template_kwargs and stream_options must be objects")
    thinking = kwargs.get("enable_thinking")
    top_k = _number(body, "top_k", int, defaults.top_k, low=-1)  # -1 (vLLM's "off") is our 0
    tools = read_tools(body, ApiError) if kind == "chat" else None
    return GenRequest(
        kind=kind,
        model=model_name,
        prompt=prompt,
        max_tokens=_number(body, max_key, int, defaults.max_new_tokens, low=1),
        temperature=_number(body, "temperature", float, defaults.temperature, low=0.0),
        top_k=0 if top_k == -1 else top_k,
        top_p=_number(body, "top_p", float, defaults.top_p, low=0.0, high=1.0, open_low=True),
        seed=_number(body, "seed", int, defaults.seed, low=0),
        repetition_penalty=_number(
            body, "repetition_penalty", float, defaults.repetition_penalty, low=0.0, open_low=True
        ),
        stop=_stop(body.get("stop"), list(defaults.stop)),
        stream=_bool(body, "stream"),
        include_usage=bool(stream_options.get("include_usage")),
        enable_thinking=None if thinking is None else bool(thinking),
        return_token_ids=_bool(body, "return_token_ids"),
        ignore_eos=_bool(body, "ignore_eos"),
        max_tokens_given=body.get(max_key) is not None,
        logprobs=_logprobs(body, kind),
        echo=kind == "completion" and _bool(body, "echo"),
        constraint=_constraint(body, tools),
        tools=tools,
    )


# OpenAI's and vLLM's sampling fields dflash does not apply, with the values that change nothing
_NEUTRAL: dict[str, tuple] = {
    "presence_penalty": (0, 0.0),
    "frequency_penalty": (0, 0.0),
    "logit_bias": ({},),
    "min_p": (0, 0.0),
    "min_tokens": (0,),
    "stop_token_ids": ([],),
    "bad_words": ([],),
    "use_beam_search": (False,),
    "prompt_logprobs": (),
}


def _constraint(body: dict, tools: ToolRequest | None) -> ConstraintSpec | None:
    """The request's own output constraint (a required tool call's cannot join it)."""
    own = read_constraint(body, ApiError)
    if own is not None and tools is not None and tools.choice != "auto":
        raise ApiError("a required tool call and an output constraint cannot both apply", param="tool_choice")
    return own  # a required call's grammar is set at intake, in the target family's format


def _logprobs(body: dict, kind: str) -> int | None:
    """Alternatives asked for per token, or None: completions' `logprobs` is their number; chat's `logprobs` is
    a switch and `top_logprobs` the number (OpenAI's shapes)."""
    if kind == "completion":
        asked = body.get("logprobs") is not None
        top = _number(body, "logprobs", int, 0, low=0, high=MAX_TOP)
    else:
        asked = _bool(body, "logprobs")
        top = _number(body, "top_logprobs", int, 0, low=0, high=MAX_TOP)
        if body.get("top_logprobs") is not None and not asked:
            raise ApiError("'top_logprobs' needs 'logprobs': true", param="top_logprobs")
    if asked and body.get("stream") and kind == "completion" and body.get("echo"):
        raise ApiError("an echoed prompt's logprobs are not streamed", param="echo", hint="ask with stream: false")
    return top if asked else None


def _refuse_lone_surrogates(body: dict) -> None:
    """JSON may escape half a UTF-16 pair ("\\ud800"); no tokenizer can encode the string it makes."""
    stack: list[tuple[str, Any]] = [("", body)]
    while stack:  # not recursive: the body may nest as deep as the JSON parser allows
        where, value = stack.pop()
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError as exc:
                bad = f"\\u{ord(value[exc.start]):04x}"
                raise ApiError(
                    f"{where or 'the body'} holds a lone UTF-16 surrogate ({bad}), which is not text",
                    param=where.split("[")[0].split(".")[0] or None,
                    hint="send valid UTF-8 (escape both halves of a surrogate pair)",
                ) from None
        elif isinstance(value, dict):
            stack += [(f"{where}.{k}" if where else str(k), v) for k, v in value.items()]
            stack += [(f"{where}.<key>" if where else "<key>", k) for k in value]
        elif isinstance(value, list):
            stack += [(f"{where}[{i}]", v) for i, v in enumerate(value)]


def _prompt(value: Any) -> str | list[int]:
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], str):
        value = value[0]
    if isinstance(value, list) and value and all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        return list(value)  # token ids
    if not isinstance(value, str):
        raise ApiError("'prompt' must be a string (or one string in a list, or a list of token ids)", param="prompt")
    return value


def _messages(value: Any) -> list[dict]:
    if not isinstance(value, list) or not value:
        raise ApiError("'messages' must be a non-empty list of {role, content} objects", param="messages")
    out = []
    for i, m in enumerate(value):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ApiError(f"messages[{i}] needs a 'role' string and 'content'", param="messages")
        content = m.get("content")
        if isinstance(content, list):  # content parts: text, and images (read later: serve/media.py)
            content = _parts(content, f"messages[{i}]")
        if content is None:
            content = ""
        if not isinstance(content, (str, list)):
            raise ApiError(f"messages[{i}].content must be a string or a list of content parts", param="messages")
        message = {"role": m["role"], "content": content}
        # An assistant's earlier calls and a tool's answer to one, as the chat template reads them
        for key, kind in (("tool_calls", list), ("tool_call_id", str), ("name", str)):
            if m.get(key) is not None:
                if not isinstance(m[key], kind):
                    raise ApiError(f"messages[{i}].{key} must be a {kind.__name__}", param="messages")
                message[key] = _tool_calls(m[key], i) if key == "tool_calls" else m[key]
        out.append(message)
    return out


def _tool_calls(calls: list, i: int) -> list[dict]:
    """An assistant message's tool_calls, with each call's arguments as an object (templates write them as JSON)."""
    import json

    out = []
    for j, c in enumerate(calls):
        f = c.get("function") if isinstance(c, dict) else None
        if not isinstance(f, dict) or not isinstance(f.get("name"), str):
            raise ApiError(f"messages[{i}].tool_calls[{j}] needs function.name", param="messages")
        args = f.get("arguments") or {}
        try:
            args = json.loads(args) if isinstance(args, str) else args
        except ValueError:
            raise ApiError(f"messages[{i}].tool_calls[{j}].function.arguments is not JSON", param="messages") from None
        out.append({**c, "function": {"name": f["name"], "arguments": args}})
    return out


def _parts(content: list, where: str) -> str | list[dict]:
    """Text parts joined into one string; with an image among them, the parts in order ({"type": "text",
    "text"} / {"type": "image", "url", "where"})."""
    parts: list[dict] = []
    for j, p in enumerate(content):
        kind = p.get("type") if isinstance(p, dict) else None
        if kind == "text" and isinstance(p.get("text"), str):
            parts.append({"type": "text", "text": p["text"]})
        elif kind == "image_url":
            image = p.get("image_url")
            url = image.get("url") if isinstance(image, dict) else image
            parts.append({"type": "image", "url": url, "where": f"{where}.content[{j}]"})
        else:
            raise ApiError(
                f"{where}.content[{j}]: only text and image_url content parts are supported", param="messages"
            )
    if all(p["type"] == "text" for p in parts):
        return "".join(p["text"] for p in parts)
    return parts


def _number(body: dict, key: str, kind: type, default: Any, *, low=None, high=None, open_low=False) -> Any:
    value = body.get(key)
    if value is None:
        return default
    numeric = isinstance(value, (int, float)) and not isinstance(value, bool)
    if not numeric or (kind is int and not float(value).is_integer()):
        raise ApiError(f"{key!r} must be {'an integer' if kind is int else 'a number'}, got {value!r}", param=key)
    value = kind(value)
    too_low = low is not None and (value <= low if open_low else value < low)
    if too_low or (high is not None and value > high):
        bound = f"{'>' if open_low else '>='} {low}" if low is not None else ""
        bound += (" and " if bound and high is not None else "") + (f"<= {high}" if high is not None else "")
        raise ApiError(f"{key!r} must be {bound}, got {value!r}", param=key)
    return value


def _bool(body: dict, key: str) -> bool:
    value = body.get(key, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise ApiError(f"{key!r} must be true or false", param=key)
    return value


def _stop(value: Any, default: list[str]) -> list[str]:
    if value is None:
        return default
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops) or len(stops) > 16:
        raise ApiError("'stop' must be a non-empty string or a list of up to 16 of them", param="stop")
    return stops


# ---------------------------------------------------------------------------------------------
# Response bodies


def finish_reason(stopped: str) -> str:
    """OpenAI's reasons; a request its client abandoned is "abort" (as vLLM counts it)."""
    return {"length": "length", "cancelled": "abort"}.get(stopped, "stop")


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def full_response(
    req: GenRequest,
    text: str,
    reason: str,
    use: dict,
    extension: dict,
    token_ids: list[int],
    logprobs: dict | None = None,
    tool_calls: list[dict] | None = None,
) -> dict[str, Any]:
    if req.kind == "chat":
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if tool_calls:
            message.update(content=text or None, tool_calls=tool_calls)
        choice = {"index": 0, "message": message, "logprobs": logprobs, "finish_reason": reason}
        obj, prefix = "chat.completion", "chatcmpl-"
    else:
        choice = {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": reason}
        obj, prefix = "text_completion", "cmpl-"
    if req.return_token_ids:
        choice["token_ids"] = token_ids
    return {
        "id": prefix + req.id,
        "object": obj,
        "created": req.created,
        "model": req.model,
        "choices": [choice],
        "usage": use,
        **extension,
    }


def chunk(
    req: GenRequest, text: str | None, reason: str | None = None, *, first: bool = False, logprobs: dict | None = None
) -> dict[str, Any]:
    """One streamed piece; `text` None with a reason is the closing chunk; `logprobs` those of the tokens
    committed since the last chunk (serve/logprobs_body.py)."""
    if req.kind == "chat":
        delta: dict[str, Any] = {"role": "assistant"} if first else {}
        if text:
            delta["content"] = text
        choice = {"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": reason}
        obj, prefix = "chat.completion.chunk", "chatcmpl-"
    else:
        choice = {"index": 0, "text": text or "", "logprobs": logprobs, "finish_reason": reason}
        obj, prefix = "text_completion", "cmpl-"
    return {"id": prefix + req.id, "object": obj, "created": req.created, "model": req.model, "choices": [choice]}


def usage_chunk(req: GenRequest, use: dict) -> dict[str, Any]:
    obj = "chat.completion.chunk" if req.kind == "chat" else "text_completion"
    prefix = "chatcmpl-" if req.kind == "chat" else "cmpl-"
    head = {"id": prefix + req.id, "object": obj, "created": req.created, "model": req.model}
    return {**head, "choices": [], "usage": use}


def tool_calls_chunk(req: GenRequest, calls: list[dict]) -> dict[str, Any]:
    """A streamed answer's calls, whole, in one delta (each with its index, as OpenAI's deltas carry)."""
    doc = chunk(req, None)
    doc["choices"][0]["delta"] = {"tool_calls": [{"index": i, **c} for i, c in enumerate(calls)]}
    return doc
