"""One streamed chat completion's server-sent events, checked as they are read: each `data:` line must
be a JSON object of the OpenAI chat.completion.chunk shape; anything else is the server's fault
(EndpointError naming the event)."""

from __future__ import annotations

import json
import time
from typing import Any

from dflash_cli.errors import EndpointError

LOG_HINT = "the server misbehaved: check its log"


class EventStream:
    """What one chat completion's server-sent events say: text pieces, their times, usage, [DONE]."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.events = 0
        self.comments = 0  # `: ...` lines (keep-alives): said when a request runs out of time
        self.text: list[str] = []
        self.first: float | None = None
        self.last: float | None = None
        self.usage: dict[str, Any] | None = None

    def take(self, raw: bytes) -> bool:
        """Read one line; True at `data: [DONE]`. Blank lines, comments and other fields are skipped."""
        self.comments += raw.startswith(b":")
        if not raw.startswith(b"data:"):
            return False
        data = raw[5:].strip()
        if data == b"[DONE]":
            return True
        self.events += 1
        try:
            doc = json.loads(data)
        except ValueError:
            raise self._bad(f"sent invalid JSON in stream event {self.events}", data) from None
        if not isinstance(doc, dict):
            raise self._bad(f"sent stream event {self.events} that is not a JSON object", data)
        if "error" in doc:
            error = doc["error"]
            message = error.get("message") if isinstance(error, dict) else error
            raise EndpointError(f"{self.url} failed mid-stream: {message}", hint="check the server log")
        usage = doc.get("usage")
        if usage is not None:
            if not isinstance(usage, dict):
                raise self._bad(f"sent `usage` as {kind_of(usage)}, not an object, in stream event {self.events}", data)
            self.usage = usage
        choices = doc.get("choices")
        if choices is None:
            return False
        if not isinstance(choices, list):
            raise self._bad(f"sent `choices` as {kind_of(choices)}, not a list, in stream event {self.events}", data)
        for choice in choices:
            if not isinstance(choice, dict):
                raise self._bad(
                    f"sent a choice as {kind_of(choice)}, not an object, in stream event {self.events}", data
                )
            delta = choice.get("delta")
            if delta is None:
                continue
            if not isinstance(delta, dict):
                raise self._bad(f"sent `delta` as {kind_of(delta)}, not an object, in stream event {self.events}", data)
            piece = delta.get("content")
            if piece is not None and not isinstance(piece, str):
                raise self._bad(
                    f"sent `content` as {kind_of(piece)}, not a string, in stream event {self.events}", data
                )
            if piece:
                self.last = time.perf_counter()
                self.first = self.first if self.first is not None else self.last
                self.text.append(piece)
        return False

    def _bad(self, what: str, data: bytes) -> EndpointError:
        return EndpointError(
            f"{self.url} {what}: {data[:80].decode(errors='replace')!r}",
            hint="bench reads OpenAI chat.completion.chunk events: check the server log",
        )


def count(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"


def kind_of(value: Any) -> str:
    """'a dict', 'a string', ... as JSON would call it."""
    names = {dict: "an object", list: "a list", str: "a string", bool: "a boolean", int: "a number", float: "a number"}
    return names.get(type(value), "null" if value is None else type(value).__name__)
