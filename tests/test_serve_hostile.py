"""`dflash serve` against impatient and hostile clients: a non-streamed request whose client leaves is
cancelled; oversized, lone-surrogate, deeply nested and bug-triggering requests each get one
OpenAI-style JSON error; tokenising never holds up other clients; a stop cut at the graceful
timeout still answers every request properly."""

from __future__ import annotations

import json
import socket
import threading
import time
from urllib.parse import urlsplit

import pytest

from tests.serving import SlowEngine, http, metric, running_server


def _raw_post(url: str, body: bytes, *, chunked: bool = False) -> tuple[int, bytes]:
    """POST with a raw socket (a declared length, or chunked without one); returns status and body."""
    parts = urlsplit(url)
    with socket.create_connection((parts.hostname, parts.port), timeout=60) as sock:
        head = f"POST {parts.path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nConnection: close\r\n"
        if chunked:
            sock.sendall((head + "Transfer-Encoding: chunked\r\n\r\n").encode())
            step = 1 << 16
            try:
                for i in range(0, len(body), step):
                    piece = body[i : i + step]
                    sock.sendall(f"{len(piece):x}\r\n".encode() + piece + b"\r\n")
                sock.sendall(b"0\r\n\r\n")
            except OSError:
                pass  # the server answered and closed before the upload ended: read what it said
        else:
            sock.sendall((head + f"Content-Length: {len(body)}\r\n\r\n").encode() + body)
        data = b""
        while chunk := sock.recv(1 << 16):
            data += chunk
    head_bytes, _, rest = data.partition(b"\r\n\r\n")
    return int(head_bytes.split(b" ", 2)[1]), rest


def _error(status_and_body: tuple[int, bytes]) -> tuple[int, dict]:
    status, body = status_and_body
    if body[:8].strip().isalnum():  # a chunked body: take the first chunk
        body = body.split(b"\r\n", 2)[1]
    return status, json.loads(body)["error"]


def test_a_non_streamed_request_is_cancelled_when_its_client_leaves(qwen3_engine):
    slow = SlowEngine(qwen3_engine, pause=0.05)
    with running_server(slow) as (url, _):
        parts = urlsplit(url)
        sock = socket.create_connection((parts.hostname, parts.port))
        body = json.dumps({"model": "tiny", "prompt": "def add(a, b):", "max_tokens": 100}).encode()
        head = f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n\r\n"
        sock.sendall(head.encode() + body)
        assert slow.started.wait(10)
        time.sleep(0.2)
        sock.close()
        result = slow.first_result()
        assert result is not None and result.stopped == "cancelled" and result.new_tokens < 100
        text = http("GET", url + "/metrics").text
        assert metric(text, "vllm:request_success_total", finished_reason="abort") == 1
        assert metric(text, "vllm:request_success_total", finished_reason="length") == 0


@pytest.fixture(scope="module")
def small_limit_server(qwen3_engine):
    with running_server(qwen3_engine, max_request_bytes=4096) as (url, app):
        yield url, app


def test_a_body_over_the_limit_is_413_before_parsing(small_limit_server):
    url = small_limit_server[0] + "/v1/completions"
    big = json.dumps({"model": "tiny", "prompt": "x" * 3_000_000}).encode()
    for chunked in (False, True):
        status, err = _error(_raw_post(url, big, chunked=chunked))
        assert status == 413 and err["code"] == "request_too_large" and "4096" in err["message"]
    ok = http("POST", url, {"model": "tiny", "prompt": "def f(x):", "max_tokens": 2})
    assert ok.status_code == 200


@pytest.mark.parametrize(
    "raw, needle",
    [
        (b'{"model": "tiny", "prompt": "abc\\ud800def"}', "lone UTF-16 surrogate"),
        (b'{"model": "tiny", "messages": [{"role": "user", "content": "\\udc00"}]}', "lone UTF-16 surrogate"),
        (b"[" * 100_000 + b"]" * 100_000, "nests too deeply"),
    ],
)
def test_unencodable_and_deep_bodies_are_400_json(qwen3_engine, raw, needle):
    with running_server(qwen3_engine, max_request_bytes=1 << 20) as (url, _):
        path = "/v1/chat/completions" if b"messages" in raw else "/v1/completions"
        res = http("POST", url + path, raw=raw)
        assert res.status_code == 400 and needle in res.json()["error"]["message"]


def test_a_bug_is_a_json_500_and_the_server_lives_on(qwen3_engine, monkeypatch):
    with running_server(qwen3_engine) as (url, app):
        intake_engine = app.state.intake.engine

        def broken(*args, **kwargs):
            raise RuntimeError("boom")

        monkeypatch.setattr(intake_engine, "encode_prompt", broken)
        res = http("POST", url + "/v1/completions", {"model": "tiny", "prompt": "x"})
        assert res.status_code == 500 and res.json()["error"]["code"] == "internal_error"
        monkeypatch.undo()
        assert (
            http("POST", url + "/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": 2}).status_code == 200
        )


def test_a_body_cut_short_by_its_client_logs_no_traceback(qwen3_engine, caplog):
    """A client that declares 1000 bytes, sends 20 and leaves: nothing to answer, and nothing is a bug."""
    with running_server(qwen3_engine) as (url, _):
        parts = urlsplit(url)
        for _ in range(3):
            with socket.create_connection((parts.hostname, parts.port), timeout=10) as sock:
                head = "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n"
                sock.sendall(head.encode() + b'{"prompt": "def f(x)')
            time.sleep(0.2)
        ok = http("POST", url + "/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": 2})
        assert ok.status_code == 200
    logged = [r for r in caplog.records if r.levelno >= 30 or r.exc_info]
    assert logged == [], [r.getMessage() for r in logged]


def test_tokenising_runs_off_the_event_loop(qwen3_engine, monkeypatch):
    with running_server(qwen3_engine) as (url, app):
        intake_engine = app.state.intake.engine
        inside, release = threading.Event(), threading.Event()
        real = intake_engine.encode_prompt

        def held(prompt):
            inside.set()
            release.wait(30)
            return real(prompt)

        monkeypatch.setattr(intake_engine, "encode_prompt", held)
        reply: dict = {}
        body = {"model": "tiny", "prompt": "def f(x):", "max_tokens": 2}
        t = threading.Thread(target=lambda: reply.update(r=http("POST", url + "/v1/completions", body)))
        t.start()
        try:
            assert inside.wait(10)
            assert http("GET", url + "/health", timeout=10).status_code == 200  # the loop is free
        finally:
            release.set()
            t.join(30)
        assert reply["r"].status_code == 200


def test_a_stop_at_the_graceful_timeout_answers_every_request(qwen3_engine):
    slow = SlowEngine(qwen3_engine, pause=0.2)
    with running_server(slow, graceful_s=0.5) as (url, app):
        replies: dict = {}

        def whole() -> None:
            replies["whole"] = http(
                "POST", url + "/v1/completions", {"model": "tiny", "prompt": "x =", "max_tokens": 100}
            )

        def stream() -> None:
            status, body = _raw_post(
                url + "/v1/completions",
                json.dumps({"model": "tiny", "prompt": "y =", "max_tokens": 100, "stream": True}).encode(),
            )
            replies["stream"] = (status, body)

        threads = [threading.Thread(target=whole), threading.Thread(target=stream)]
        for t in threads:
            t.start()
        assert slow.started.wait(10)
        deadline = time.monotonic() + 10
        while http("GET", url + "/health").json()["waiting"] < 1 and time.monotonic() < deadline:
            time.sleep(0.02)  # one decoding, one waiting
        app.state.stop()
        for t in threads:
            t.join(30)
    whole_reply = replies["whole"]
    assert whole_reply.status_code == 503 and whole_reply.json()["error"]["code"] == "server_shutting_down"
    status, body = replies["stream"]
    events = [line[6:].strip() for line in body.split(b"\r\n") if line.startswith(b"data: ")]
    assert status == 200 and events[-1] == b"[DONE]"
    assert json.loads(events[-2])["choices"][0]["finish_reason"] == "abort"
