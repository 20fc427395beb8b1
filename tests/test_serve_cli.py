"""`dflash serve` as a process: it prints where it listens, finishes the request in flight on SIGTERM
and exits 0; an address in use and a misspelt engine are one-line errors; --print-command."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading

from typer.testing import CliRunner

from dflash_cli.cli.app import create_app
from tests.serving import http


def _argv(engine, *extra: str) -> list[str]:
    recipe, cache = str(engine.recipe.source), str(engine.compile_dir.parents[2])
    return ["serve", "-r", recipe, "--cache-dir", cache, *extra]


def test_sigterm_finishes_the_request_in_flight_and_exits_0(qwen3_engine):
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "dflash_cli", *_argv(qwen3_engine, "--port", "0")],
        stderr=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        line = ""
        while "serving" not in line:
            line = proc.stderr.readline()
            assert line or proc.poll() is None, "server exited before listening"
        url = re.search(r"http://\S+/v1", line).group(0)
        assert http("GET", url + "/models").json()["data"][0]["id"] == qwen3_engine.recipe.name

        # A streamed request; the stop signal arrives once its first tokens are out.
        reply: dict = {}
        first = threading.Event()

        def stream() -> None:
            import http.client
            from urllib.parse import urlsplit

            parts = urlsplit(url)
            conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=60)
            body = {"prompt": "def add(a, b):", "max_tokens": 100, "stream": True}
            conn.request("POST", "/v1/completions", json.dumps(body), {"content-type": "application/json"})
            res = conn.getresponse()
            events = []
            for raw in res:
                if raw.startswith(b"data: "):
                    events.append(raw[6:].strip())
                    first.set()
            reply["events"] = events

        t = threading.Thread(target=stream)
        t.start()
        assert first.wait(30)
        proc.send_signal(signal.SIGTERM)
        t.join(60)
        assert proc.wait(60) == 0, proc.stderr.read()
        events = reply["events"]
        assert events[-1] == b"[DONE]"
        assert json.loads(events[-2])["choices"][0]["finish_reason"] in ("stop", "length")
        assert "stopped" in proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()


def test_address_in_use_is_one_error_line(qwen3_engine):
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen(1)
    try:
        res = CliRunner().invoke(create_app(), _argv(qwen3_engine, "--port", str(holder.getsockname()[1])))
    finally:
        holder.close()
    assert res.exit_code == 1
    assert "error: cannot listen on 127.0.0.1" in res.stderr and "hint:" in res.stderr


def test_print_command_and_a_misspelt_engine(qwen3_engine):
    res = CliRunner().invoke(create_app(), _argv(qwen3_engine, "--print-command", "vllm"))
    assert res.exit_code == 0 and '"method": "dflash"' in res.stdout
    res = CliRunner().invoke(create_app(), _argv(qwen3_engine, "--print-command", "vlm"))
    flat = " ".join(res.stderr.replace("│", " ").split())  # rich wraps the usage box
    assert res.exit_code == 2 and "did you mean 'vllm'" in flat
