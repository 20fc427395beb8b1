"""Helpers for the serve tests: a real uvicorn server on 127.0.0.1 in a thread, and engine wrappers
that make timing deterministic (a gate that holds a generation, a pause per committed step)."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from typing import Any


@contextlib.contextmanager
def running_server(
    engine: Any, model_name: str = "tiny", graceful_s: float = 30.0, **kwargs: Any
) -> Iterator[tuple[str, Any]]:
    """The app in `dflash serve`'s own uvicorn server; `app.state.stop()` begins its shutdown."""
    from dflash_cli.serve.app import create_app
    from dflash_cli.serve.server import bind, build_server

    app = create_app(engine, model_name=model_name, **kwargs)
    sock = bind("127.0.0.1", 0)
    server = build_server(app, graceful_s=graceful_s)
    app.state.stop = lambda: setattr(server, "should_exit", True)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.02)
    assert server.started, "the test server did not start"
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}", app
    finally:
        server.should_exit = True
        thread.join(20)
        app.state.scheduler.close()


class SlowEngine:
    """The real engine, but each committed step waits `pause` seconds and `gate` must be open to start."""

    def __init__(self, engine: Any, pause: float = 0.0) -> None:
        self._engine, self.pause = engine, pause
        self.gate = threading.Event()
        self.gate.set()
        self.started = threading.Event()
        self.results: list[Any] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    def generate(self, prompt_ids, *, on_commit=None, **kwargs):
        self.started.set()
        self.gate.wait(30)

        def slow_commit(new):
            time.sleep(self.pause)
            return on_commit(new) if on_commit else None

        result = self._engine.generate(prompt_ids, on_commit=slow_commit, **kwargs)
        self.results.append(result)
        return result

    def first_result(self, timeout: float = 10) -> Any:
        """The first generation's result once it has ended (None if none ends in `timeout` seconds)."""
        deadline = time.monotonic() + timeout
        while not self.results and time.monotonic() < deadline:
            time.sleep(0.05)
        return self.results[0] if self.results else None


def metric(text: str, name: str, **labels: str) -> float:
    """One sample's value from Prometheus text (labels other than those given are ignored)."""
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(name)


class Reply:
    def __init__(self, status: int, headers: Any, body: bytes) -> None:
        self.status_code, self.headers, self.content = status, headers, body

    @property
    def text(self) -> str:
        return self.content.decode()

    def json(self) -> Any:
        import json

        return json.loads(self.content)


def http(method: str, url: str, body: Any = None, *, raw: bytes | None = None, timeout: float = 60) -> Reply:
    """One HTTP request with the standard library (no client library's retries or parsing in the way)."""
    import json
    import urllib.error
    import urllib.request

    data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
    req = urllib.request.Request(url, data=data, method=method, headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as res:
            return Reply(res.status, res.headers, res.read())
    except urllib.error.HTTPError as err:
        return Reply(err.code, err.headers, err.read())


def read_one_event_then_disconnect(url: str, body: Any) -> str:
    """POST a streaming request, read until the first data event, then drop the connection."""
    import http.client
    import json
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=60)
    conn.request("POST", parts.path, json.dumps(body), {"content-type": "application/json"})
    res = conn.getresponse()
    line = b""
    while not line.startswith(b"data: {"):
        line = res.fp.readline()
    conn.sock.shutdown(2)
    conn.close()
    return line.decode()
