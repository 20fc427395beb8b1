"""`dflash bench --endpoint URL`: the client for any OpenAI-compatible server (the run over a dataset is
bench/endpoint_run.py, the spec-decode counters bench/spec_counters.py).

Requests go one at a time to `/v1/chat/completions` with `stream: true` (each turn of a sample
after the earlier turns and the server's replies), timed by the client: TTFT to the first text
chunk, TPOT = (last chunk - first chunk) / (completion tokens - 1). Acceptance comes from the
server's Prometheus `/metrics` spec-decode counters (vLLM's names: vLLM, SGLang with them, and
`dflash serve`), read before and after each request; without them it is reported as unavailable.
With a recipe as well, greedy runs compare the server's text with plain decoding of that recipe.

A misbehaving server fails the run with one EndpointError line naming the fault and the request
(sample, turn): a request not finished within `--timeout` (connecting included), a bad status line, a
body cut short, a line longer than MAX_LINE, invalid or ill-typed events, a stream without
`data: [DONE]` or without the `usage` that the token count comes from, a usage count no request can
have. An incomplete reply is never counted as a result. Counters on /metrics that are no finite count,
or that go backwards, make acceptance unavailable (saying why) rather than a number.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlsplit

from dflash_cli.bench.endpoint_stream import LOG_HINT, EventStream, count
from dflash_cli.bench.spec_counters import NO_COUNTERS, parse_counters
from dflash_cli.errors import DFlashError, EndpointError

DEFAULT_TIMEOUT_S = 600.0  # the longest one request may take, connecting included (`--timeout`)
# The longest line of a stream bench reads: an event is a few hundred bytes, so a longer line is a broken
# server, and reading it whole would buffer whatever the server sends (300 MiB grew bench to 1.8 GB).
# A GET body (/metrics, /v1/models) may be longer, but not without end either.
MAX_LINE = 4 << 20
MAX_BODY = 64 << 20


class _Deadline:
    """The end of one request's `--timeout`. A socket timeout bounds each read, not a request: a server
    trickling keep-alive comments, or one endless line, would never trip it. So a timer shuts the socket
    when the time is up; the blocked read then ends, and `hit` tells the caller why."""

    def __init__(self, seconds: float) -> None:
        self.end, self.hit = time.monotonic() + seconds, False
        self._timer: threading.Timer | None = None

    def watch(self, sock: socket.socket) -> None:
        self._timer = threading.Timer(max(0.0, self.end - time.monotonic()), self._expire, (sock,))
        self._timer.daemon = True
        self._timer.start()

    def _expire(self, sock: socket.socket) -> None:
        self.hit = True
        with contextlib.suppress(OSError):
            socket.socket.shutdown(sock, socket.SHUT_RDWR)  # the raw socket's, also under TLS

    def cancel(self) -> None:
        if self._timer is not None:
            self._timer.cancel()


class Endpoint:
    """A small client for one OpenAI-compatible server (standard library only).

    `timeout` bounds each whole request, from connecting to the last byte of its reply. Whatever the
    server does wrong (no complete answer in time, a bad status line, a body cut short, an overlong line,
    invalid or ill-typed events, a stream without `data: [DONE]` or without sound usage counts) raises
    EndpointError naming the fault.
    """

    def __init__(self, url: str, timeout: float = DEFAULT_TIMEOUT_S) -> None:
        parts = urlsplit(url if "://" in url else f"http://{url}")
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise DFlashError(f"not an http(s) URL: {url!r}", hint="e.g. --endpoint http://127.0.0.1:8000")
        self.url, self.timeout = url, timeout
        self.https = parts.scheme == "https"
        self.host, self.port = parts.hostname, parts.port or (443 if self.https else 80)
        self.prefix = parts.path.rstrip("/").removesuffix("/v1")

    @contextlib.contextmanager
    def _request(self, method: str, path: str, body: str | None = None) -> Iterator[tuple[Any, _Deadline]]:
        """(response, its deadline) once the status line and headers are in; closed on leaving."""
        cls = http.client.HTTPSConnection if self.https else http.client.HTTPConnection
        conn = cls(self.host, self.port, timeout=self.timeout)
        deadline, res = _Deadline(self.timeout), None
        try:
            try:
                conn.connect()
            except TimeoutError:
                raise EndpointError(
                    f"{self.url} accepted no connection within {self.timeout:g} s (--timeout {self.timeout:g})",
                    hint="check the address; raise --timeout if the server is just slow",
                ) from None
            except OSError as exc:
                raise EndpointError(
                    f"cannot reach {self.url}: {exc.strerror or exc}",
                    hint="start the server first (e.g. `dflash serve`)",
                ) from None
            deadline.watch(conn.sock)
            try:
                headers = {"content-type": "application/json"} if body is not None else {}
                conn.request(method, self.prefix + path, body, headers)
                res = conn.getresponse()
            except (OSError, http.client.HTTPException, ValueError) as exc:
                raise self._fault(exc, f"while answering {method} {path}", deadline) from exc
            yield res, deadline
        finally:
            deadline.cancel()
            if res is not None:
                res.close()  # a close-delimited reply owns the socket: closing it hangs up on the server
            conn.close()

    def _late(self, what: str, where: str) -> EndpointError:
        return EndpointError(
            f"{self.url} {what} within {self.timeout:g} s (--timeout {self.timeout:g}) {where}",
            hint=f"--timeout bounds each whole request: raise it (e.g. --timeout {max(1200, 5 * self.timeout):g}) "
            "if the server is just slow, or check its log",
        )

    def _fault(self, exc: BaseException, where: str, deadline: _Deadline | None = None) -> EndpointError:
        """The server's fault behind a low-level exception, as one line and a hint."""
        if isinstance(exc, TimeoutError) or (deadline is not None and deadline.hit):
            # The socket's own timeout is --timeout too, so either way the request ran out of time.
            return self._late("sent no complete reply", where)
        if isinstance(exc, http.client.RemoteDisconnected):
            return EndpointError(f"{self.url} closed the connection without a reply {where}", hint=LOG_HINT)
        if isinstance(exc, http.client.BadStatusLine):
            line = str(exc).strip()[:80]
            return EndpointError(
                f"{self.url} sent a bad HTTP status line {where}: {line!r}",
                hint="is an OpenAI-compatible HTTP server listening at that address and port?",
            )
        if isinstance(exc, http.client.IncompleteRead):
            return EndpointError(
                f"{self.url} cut the reply short {where}: the connection closed mid-body ({exc!r})", hint=LOG_HINT
            )
        if isinstance(exc, (http.client.HTTPException, ValueError)):
            return EndpointError(f"{self.url} sent a malformed HTTP reply {where}: {exc}", hint=LOG_HINT)
        if isinstance(exc, OSError):
            return EndpointError(
                f"the connection to {self.url} broke {where}: {exc.strerror or exc}",
                hint="is the server still running?",
            )
        return EndpointError(f"{self.url} failed {where}: {exc}", hint=LOG_HINT)

    def get(self, path: str) -> tuple[int, bytes]:
        with self._request("GET", path) as (res, deadline):
            return res.status, self._read_all(res, deadline, f"while sending GET {path}")

    def model(self) -> str:
        status, body = self.get("/v1/models")
        try:
            return json.loads(body)["data"][0]["id"]
        except (ValueError, KeyError, IndexError, TypeError):
            raise EndpointError(
                f"{self.url}/v1/models answered {status} without a model", hint="pass --model NAME"
            ) from None

    def counters(self) -> dict[str, Any] | str:
        """The server's spec-decode counters (summed over label sets), or why there are none to use."""
        status, body = self.get("/metrics")
        return parse_counters(body.decode(errors="replace")) if status == 200 else NO_COUNTERS

    def chat(self, model: str, messages: list[dict], settings: Any, seed: int) -> dict[str, Any]:
        body = {
            "model": model,
            "messages": messages,
            "max_tokens": settings.max_new_tokens,
            "temperature": settings.temperature,
            "top_p": settings.top_p,
            "seed": seed,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if settings.top_k:
            body["top_k"] = settings.top_k
        t0 = time.perf_counter()
        with self._request("POST", "/v1/chat/completions", json.dumps(body)) as (res, deadline):
            if res.status != 200:
                where = f"while sending its {res.status} reply"
                detail = self._read_all(res, deadline, where, partial=True).decode(errors="replace")[:300]
                raise EndpointError(
                    f"{self.url} answered {res.status}: {detail}", hint="check --model and the server log"
                )
            ctype = (res.getheader("content-type") or "").split(";")[0].strip().lower()
            if ctype == "application/json":
                raise EndpointError(
                    f"{self.url} answered with a non-streamed reply (content-type {ctype}) to a `stream: true` request",
                    hint="bench times tokens as they stream: the server must stream chat completions (SSE)",
                )
            stream = EventStream(self.url)
            promised = res.length
            for raw in self._lines(res, stream, deadline):
                if not raw.endswith(b"\n") and raw.rstrip() not in (b"data: [DONE]", b"data:[DONE]"):
                    raise EndpointError(
                        f"{self.url} cut the stream short: the connection closed mid-line after "
                        f"{count(stream.events, 'event')} ({raw[:60]!r})",
                        hint=LOG_HINT,
                    )
                if stream.take(raw):
                    break
            else:
                if res.length:  # a Content-Length the body never reached
                    raise EndpointError(
                        f"{self.url} cut the stream short: the connection closed with {res.length} of its "
                        f"{promised} promised bytes missing, after {count(stream.events, 'event')}",
                        hint=LOG_HINT,
                    )
                raise EndpointError(
                    f"{self.url} ended the stream without `data: [DONE]` after {count(stream.events, 'event')}",
                    hint="the server stopped mid-reply: check its log",
                )
        end = time.perf_counter()
        if stream.usage is None or stream.usage.get("completion_tokens") is None:
            raise EndpointError(
                f"{self.url}'s stream carried no `usage` with `completion_tokens` "
                "(bench asks for it with stream_options.include_usage)",
                hint="bench counts tokens by it: use a server that honours stream_options.include_usage "
                "(vLLM, SGLang, dflash serve)",
            )
        # Every count is used as one (10^12 tokens ran out of memory, or gave 10^14 tokens/s under load).
        prompt = stream.usage.get("prompt_tokens")
        for name, value, most in (
            ("completion_tokens", stream.usage["completion_tokens"], settings.max_new_tokens),
            ("prompt_tokens", 0 if prompt is None else prompt, None),
        ):
            why = _count_fault(value, most)
            if why is not None:
                raise EndpointError(
                    f"{self.url} reported `usage.{name}` {json.dumps(value)[:40]}: {why}",
                    hint="bench counts tokens by the server's usage: check the server",
                )
        return {
            "text": "".join(stream.text),
            "t0": t0,
            "first": stream.first,
            "last": stream.last,
            "end": end,
            "usage": stream.usage,
        }

    def _lines(self, res: Any, stream: EventStream, deadline: _Deadline) -> Iterator[bytes]:
        """The response's lines as they arrive, each at most MAX_LINE bytes; a read failure, the deadline or
        an overlong line becomes the server's fault."""
        while True:
            after = f"mid-stream, after {count(stream.events, 'event')}" + (
                f" and {count(stream.comments, 'comment line')} (SSE keep-alives)" if stream.comments else ""
            )
            try:
                raw = res.readline(MAX_LINE)
            except (OSError, http.client.HTTPException, ValueError) as exc:
                if deadline.hit or isinstance(exc, TimeoutError):
                    raise self._late("did not finish its reply", after) from exc
                raise self._fault(exc, after) from exc
            if deadline.hit:  # the socket was shut: what came last is cut, not the server's end
                raise self._late("did not finish its reply", after)
            if len(raw) >= MAX_LINE and not raw.endswith(b"\n"):
                raise EndpointError(
                    f"{self.url} sent a line of over {MAX_LINE >> 20} MiB (no newline in {MAX_LINE} bytes) "
                    f"{after}: {raw[:60]!r}",
                    hint="bench reads SSE events of a few hundred bytes each: " + LOG_HINT,
                )
            if not raw:
                return
            yield raw

    def _read_all(self, res: Any, deadline: _Deadline, where: str, *, partial: bool = False) -> bytes:
        """The body, at most MAX_BODY bytes (`partial`: the first bytes of a longer one, e.g. an error's)."""
        try:
            body = res.read(65536 if partial else MAX_BODY + 1)
        except (OSError, http.client.HTTPException, ValueError) as exc:
            raise self._fault(exc, where, deadline) from exc
        if deadline.hit:
            raise self._late("sent no complete reply", where)
        if len(body) > MAX_BODY and not partial:
            raise EndpointError(
                f"{self.url} sent a body of over {MAX_BODY >> 20} MiB {where}",
                hint="bench reads small bodies: " + LOG_HINT,
            )
        return body


def _count_fault(value: Any, most: int | None) -> str | None:
    """Why a usage count cannot be this request's count of tokens, or None."""
    if not isinstance(value, int) or isinstance(value, bool):
        return "not a whole number"
    if value < 0:
        return "negative"
    if most is not None and value > most:
        return f"more than the request's max_tokens {most}"
    return None
