"""Fake OpenAI-compatible servers for `dflash bench --endpoint`: one well-behaved, the others each
misbehaving in one way on `POST /v1/chat/completions` (GET /v1/models and /metrics always answer
properly, so the fault lands on a benchmark request).

    url, stop = start("bad_json")   # a thread serving on 127.0.0.1, a free port
    ...
    stop()

Or by hand: `python -m tests.fake_endpoints bad_json [--port 8123]` serves until Ctrl-C.
Raw sockets, so a reply can be as broken as a real server's can be.
"""

from __future__ import annotations

import argparse
import json
import socket
import socketserver
import threading
import time
from collections.abc import Callable

MODEL = "fake-model"


def _event(doc: object) -> bytes:
    return b"data: " + json.dumps(doc).encode() + b"\n\n"


def _delta(text: str) -> dict:
    return {"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"content": text}}]}


def _answer(status: str, body: bytes, ctype: str = "application/json") -> bytes:
    head = f"HTTP/1.1 {status}\r\ncontent-type: {ctype}\r\ncontent-length: {len(body)}\r\nconnection: close\r\n\r\n"
    return head.encode() + body


def _usage(prompt_tokens: object = 5, completion_tokens: object = 3) -> dict:
    return {"choices": [], "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens}}


_TEXT_EVENTS = _event(_delta("Hel")) + _event(_delta("lo")) + _event(_delta("!"))
_GOOD_EVENTS = _TEXT_EVENTS + _event(_usage())
_SSE_HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nconnection: close\r\n"


def _stream(events: bytes) -> bytes:
    """A close-delimited event stream (no length, not chunked): the body ends when the socket closes."""
    return _SSE_HEAD + b"\r\n" + events


# What each kind answers to POST /v1/chat/completions (raw bytes, then the connection closes).
REPLIES: dict[str, bytes] = {
    "ok": _stream(_GOOD_EVENTS + b"data: [DONE]\n\n"),
    "garbage_status": b"GARBAGE\r\n\r\n",
    "bad_json": _stream(_event(_delta("Hel")) + b'data: {"choices": [{"delta": {"content": "lo"\n\n'),
    "choices_dict": _stream(_event({"choices": {"0": {"delta": {"content": "Hello"}}}}) + b"data: [DONE]\n\n"),
    "choices_str": _stream(_event({"choices": "Hello"}) + b"data: [DONE]\n\n"),
    # A complete, valid non-streamed reply although bench asks for `stream: true`.
    "not_streamed": _answer(
        "200 OK",
        json.dumps(
            {
                "object": "chat.completion",
                "choices": [{"index": 0, "message": {"role": "assistant", "content": "Hello!"}}],
                "usage": {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8},
            }
        ).encode(),
    ),
    # Promises 4096 bytes, sends one event, closes.
    "cut_short": _SSE_HEAD + b"content-length: 4096\r\n\r\n" + _event(_delta("Hel")),
    # Chunked, closes in the middle of a chunk.
    "cut_short_chunked": _SSE_HEAD
    + b"transfer-encoding: chunked\r\n\r\n"
    + b"%x\r\n" % len(_event(_delta("Hel")))
    + _event(_delta("Hel"))
    + b"\r\n400\r\ndata: {",
    # Text and usage, then the stream just ends: no `data: [DONE]`.
    "no_done": _stream(_GOOD_EVENTS),
    # Text and [DONE] but no usage chunk: bench cannot count the tokens.
    "no_usage": _stream(_event(_delta("Hel")) + _event(_delta("lo")) + b"data: [DONE]\n\n"),
    # Usage no request can have: 10^12 tokens for a few max_tokens, a negative count, a fractional one.
    "huge_usage": _stream(_TEXT_EVENTS + _event(_usage(completion_tokens=10**12)) + b"data: [DONE]\n\n"),
    "negative_usage": _stream(_TEXT_EVENTS + _event(_usage(prompt_tokens=-5)) + b"data: [DONE]\n\n"),
    "fractional_usage": _stream(_TEXT_EVENTS + _event(_usage(completion_tokens=2.5)) + b"data: [DONE]\n\n"),
}


def _counters(drafts: object, draft_tokens: object, accepted: object) -> bytes:
    return (
        f"# TYPE vllm:spec_decode_num_drafts_total counter\n"
        f"vllm:spec_decode_num_drafts_total {drafts}\n"
        f"vllm:spec_decode_num_draft_tokens_total {draft_tokens}\n"
        f"vllm:spec_decode_num_accepted_tokens_total {accepted}\n"
    ).encode()


# Kinds that answer chats well but serve a bad /metrics page (a function of how many GETs came before):
# values that are no number, NaN / infinite, negative, or counters that go backwards between reads.
METRICS = {
    "bad_metrics": lambda n: (
        b"# TYPE vllm:spec_decode_num_drafts_total counter\n"
        b"vllm:spec_decode_num_drafts_total 1.2.3\n"
        b"vllm:spec_decode_num_accepted_tokens_total oops\n"
    ),
    "nan_metrics": lambda n: _counters("NaN", "+Inf", 3),
    "negative_metrics": lambda n: _counters(-4, -12, -2),
    "backwards_metrics": lambda n: _counters(1000 - 10 * n, 1000 - 30 * n, 1000 - 30 * n),
}
# "silent" and "stalls" hold the connection instead (see _Handler): never a byte, or a first event and
# then nothing. "keepalive" sends SSE comment lines for KEEPALIVE_S (a client without a whole-request
# limit waits all of it; bounded, so a test never hangs); "long_line" 300 MiB of one line, no newline.
KINDS = (*REPLIES, "silent", "stalls", "keepalive", "long_line", *METRICS)
KEEPALIVE_S = 15.0
LONG_LINE_MIB = 300


class _Handler(socketserver.BaseRequestHandler):
    server: _Server

    def handle(self) -> None:
        sock: socket.socket = self.request
        sock.settimeout(30)
        try:
            head, body = self._read_request(sock)
        except OSError:
            return
        line = head.split(b"\r\n", 1)[0].decode(errors="replace")
        method, path = (line.split(" ") + ["", ""])[:2]
        try:
            if method == "GET" and path.endswith("/v1/models"):
                sock.sendall(_answer("200 OK", json.dumps({"object": "list", "data": [{"id": MODEL}]}).encode()))
            elif method == "GET" and path.endswith("/metrics") and self.server.kind in METRICS:
                sock.sendall(_answer("200 OK", METRICS[self.server.kind](self.server.count("metrics")), "text/plain"))
            elif method == "GET":
                sock.sendall(_answer("404 Not Found", b"not found", "text/plain"))
            elif self.server.count("chat") < self.server.good_first or self.server.kind in METRICS:
                sock.sendall(REPLIES["ok"])
            elif self.server.kind == "silent":
                self.server.stopping.wait()
            elif self.server.kind == "stalls":
                sock.sendall(_SSE_HEAD + b"\r\n" + _event(_delta("Hel")))
                self.server.stopping.wait()
            elif self.server.kind == "keepalive":  # until the client hangs up (a send fails), stop() or the end
                sock.sendall(_SSE_HEAD + b"\r\n")
                end = time.monotonic() + KEEPALIVE_S
                while time.monotonic() < end and not self.server.stopping.wait(0.02):
                    sock.sendall(b": keepalive\n\n")
            elif self.server.kind == "long_line":
                sock.sendall(_SSE_HEAD + b"\r\n" + b'data: {"choices": [{"delta": {"content": "')
                chunk = b"x" * (1 << 20)
                for _ in range(LONG_LINE_MIB):
                    if self.server.stopping.is_set():
                        break
                    sock.sendall(chunk)
            else:
                sock.sendall(REPLIES[self.server.kind])
        except OSError:
            pass

    @staticmethod
    def _read_request(sock: socket.socket) -> tuple[bytes, bytes]:
        data = b""
        while b"\r\n\r\n" not in data:
            chunk = sock.recv(65536)
            if not chunk:
                raise ConnectionError("client went away")
            data += chunk
        head, body = data.split(b"\r\n\r\n", 1)
        length = 0
        for line in head.split(b"\r\n")[1:]:
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-length":
                length = int(value.strip())
        while len(body) < length:
            chunk = sock.recv(65536)
            if not chunk:
                break
            body += chunk
        return head, body


class _Server(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, kind: str, port: int = 0, good_first: int = 0) -> None:
        if kind not in KINDS:
            raise ValueError(f"unknown kind {kind!r}; one of {', '.join(KINDS)}")
        self.kind, self.good_first = kind, good_first
        self.stopping = threading.Event()
        self._counts: dict[str, int] = {}
        self._lock = threading.Lock()
        super().__init__(("127.0.0.1", port), _Handler)

    def count(self, what: str) -> int:
        """How many requests of `what` ("chat", "metrics") came before this one."""
        with self._lock:
            self._counts[what] = self._counts.get(what, 0) + 1
            return self._counts[what] - 1


def start(kind: str, port: int = 0, good_first: int = 0) -> tuple[str, Callable[[], None]]:
    """Serve `kind` in a daemon thread (the first `good_first` chat requests answered well); returns
    (base URL, stop)."""
    server = _Server(kind, port, good_first)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()

    def stop() -> None:
        server.stopping.set()
        server.shutdown()
        server.server_close()
        thread.join(5)

    return f"http://127.0.0.1:{server.server_address[1]}", stop


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("kind", choices=KINDS)
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--good-first", type=int, default=0, help="answer the first N chat requests well")
    args = parser.parse_args()
    server = _Server(args.kind, args.port, args.good_first)
    print(f"http://127.0.0.1:{server.server_address[1]}  ({args.kind})", flush=True)
    try:
        server.serve_forever(poll_interval=0.05)
    except KeyboardInterrupt:
        pass
    finally:
        server.stopping.set()
        server.server_close()


if __name__ == "__main__":
    main()
