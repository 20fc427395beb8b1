"""`dflash bench --endpoint` against misbehaving servers: each fault is one `error:` line naming it and the
request it happened on, never a traceback, never a result; `--timeout` bounds each whole request (a server
that goes quiet, or trickles keep-alives); unusable /metrics counters make acceptance unavailable, saying why."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from dflash_cli.cli.app import create_app
from tests.fake_endpoints import start

# kind -> what the error line must say (the server's fault)
FAULTS = {
    "garbage_status": "sent a bad HTTP status line while answering POST /v1/chat/completions: 'GARBAGE'",
    "bad_json": "sent invalid JSON in stream event 2",
    "choices_dict": "sent `choices` as an object, not a list",
    "choices_str": "sent `choices` as a string, not a list",
    "not_streamed": "answered with a non-streamed reply (content-type application/json)",
    "cut_short": "cut the stream short: the connection closed with",
    "cut_short_chunked": "cut the reply short mid-stream, after 1 event: the connection closed mid-body",
    "no_done": "ended the stream without `data: [DONE]` after 4 events",
    "no_usage": "stream carried no `usage` with `completion_tokens`",
    "silent": "sent no complete reply within 1 s (--timeout 1) while answering POST /v1/chat/completions",
    "stalls": "did not finish its reply within 1 s (--timeout 1) mid-stream, after 1 event",
    # Was never cut off: each comment line restarted the socket's idle timeout.
    "keepalive": "did not finish its reply within 1 s (--timeout 1) mid-stream, after 0 events and ",
    # Was read whole (300 MiB: 1.8 GB).
    "long_line": "sent a line of over 4 MiB (no newline in 4194304 bytes) mid-stream, after 0 events",
    # Was a MemoryError traceback (a list of 10^12 placeholder tokens).
    "huge_usage": "reported `usage.completion_tokens` 1000000000000: more than the request's max_tokens 8",
    "negative_usage": "reported `usage.prompt_tokens` -5: negative",
    "fractional_usage": "reported `usage.completion_tokens` 2.5: not a whole number",
}


@pytest.fixture
def data(tmp_path: Path) -> Path:
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ["first prompt", "second prompt"]))
    return path


def _bench(url: str, data: Path, *args: str):
    common = ["bench", "--endpoint", url, "--dataset", str(data), "--max-new-tokens", "8", "--warmup", "0"]
    return CliRunner().invoke(create_app(), [*common, *args])


def _error_lines(res) -> list[str]:
    return [line for line in res.stderr.splitlines() if line.startswith("error:")]


def test_a_well_behaved_server_still_benchmarks(data: Path):
    url, stop = start("ok")
    try:
        res = _bench(url, data, "--json", "--timeout", "5")
    finally:
        stop()
    assert res.exit_code == 0, res.output
    ep = json.loads(res.stdout)["endpoint"]
    assert ep["completed"] == 2 and ep["new_tokens"] == 6  # usage's completion_tokens, 3 a request
    assert ep["spec_decode"].startswith("unavailable")


@pytest.mark.parametrize("kind", list(FAULTS))
def test_a_misbehaving_server_is_one_error_line_naming_the_fault_and_the_sample(kind: str, data: Path, tmp_path: Path):
    # The first request is answered well, the second (sample p/2) misbehaves.
    url, stop = start(kind, good_first=1)
    earlier = tmp_path / "earlier.json"
    earlier.write_text('{"from": "an earlier run"}\n')
    try:
        res = _bench(url, data, "--timeout", "1", "--output", str(earlier))
    finally:
        stop()
    assert res.exit_code == 1, res.output
    assert res.exception is None or isinstance(res.exception, SystemExit), repr(res.exception)
    assert "Traceback" not in res.output
    errors = _error_lines(res)
    assert len(errors) == 1, res.stderr
    assert errors[0].startswith("error: request 2/2 (sample p/2, turn 1): ")
    assert url in errors[0] and FAULTS[kind] in errors[0]
    assert res.stderr.count("hint:") == 1
    assert "endpoint [1/2]" in res.stderr and "endpoint [2/2]" not in res.stderr  # not counted as a result
    assert earlier.read_text() == '{"from": "an earlier run"}\n'  # a failed run writes no --output


def test_timeout_bounds_a_whole_request_of_keepalives(data: Path):
    """A server trickling `: keepalive` lines: --timeout 5 ran 150 s (the fake stops after 15 s)."""
    url, stop = start("keepalive")
    began = time.monotonic()
    try:
        res = _bench(url, data, "--timeout", "1")
    finally:
        stop()
    assert res.exit_code == 1 and time.monotonic() - began < 8, res.output
    assert "comment lines (SSE keep-alives)" in _error_lines(res)[0]
    assert "hint: --timeout bounds each whole request" in res.stderr


def test_a_failing_warmup_request_names_its_sample(data: Path):
    url, stop = start("no_done")
    try:
        res = CliRunner().invoke(create_app(), ["bench", "--endpoint", url, "--dataset", str(data), "--timeout", "5"])
    finally:
        stop()
    assert res.exit_code == 1 and _error_lines(res) == [
        f"error: warmup request 1/1 (sample p/1): {url} ended the stream without `data: [DONE]` after 4 events"
    ]


def test_unreadable_metrics_values_mean_acceptance_unavailable(data: Path):
    url, stop = start("bad_metrics")
    try:
        res = _bench(url, data, "--json")
    finally:
        stop()
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["endpoint"]["spec_decode"].startswith("unavailable")


# kind -> why acceptance is unavailable (was: a ValueError traceback for NaN, numbers from negative
# counters, tau 4.00 from counters going backwards)
METRICS_FAULTS = {
    "nan_metrics": "/metrics gave vllm:spec_decode_num_drafts_total = NaN, not a finite count >= 0",
    "negative_metrics": "/metrics gave vllm:spec_decode_num_drafts_total = -4, not a finite count >= 0",
    "backwards_metrics": "the spec-decode counters on /metrics went backwards over request 1/2 (sample p/1, turn 1)",
}


@pytest.mark.parametrize("kind", list(METRICS_FAULTS))
def test_unusable_metrics_counters_mean_acceptance_unavailable_saying_why(kind: str, data: Path):
    url, stop = start(kind)
    try:
        as_json = _bench(url, data, "--json")
        as_table = _bench(url, data)
    finally:
        stop()
    for res in as_json, as_table:
        assert res.exit_code == 0 and "Traceback" not in res.output, res.output
    doc = json.loads(as_json.stdout)
    assert doc["endpoint"]["spec_decode"] == f"unavailable: {METRICS_FAULTS[kind]}" + (
        " (was the server restarted?)" if kind == "backwards_metrics" else ""
    )
    assert doc["mean_acceptance_length"] is None and "spec_decode_acceptance_length" not in doc["endpoint"]
    assert f"endpoint acceptance (tau): unavailable: {METRICS_FAULTS[kind]}" in as_table.stdout


def test_impossible_usage_under_load_is_a_failed_request_not_a_throughput(data: Path):
    """`--concurrency`: 10^12 completion tokens gave 2.9e14 tok/s; now that request fails, with its reason."""
    url, stop = start("huge_usage", good_first=1)
    try:
        res = _bench(url, data, "--concurrency", "1", "--json", "--timeout", "5")
    finally:
        stop()
    assert res.exit_code == 0, res.output
    load = json.loads(res.stdout)["load"][0]
    assert (load["completed"], load["failed"], load["total_output_tokens"]) == (1, 1, 3)
    assert "more than the request's max_tokens 8" in load["failures"][0]


def test_the_real_command_prints_no_traceback(data: Path):
    """Outside CliRunner too: the installed entry point's whole stderr is the settings, one error, one hint."""
    url, stop = start("garbage_status")
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "dflash_cli", "bench", "--endpoint", url, "--dataset", str(data)]
            + ["--max-new-tokens", "8", "--warmup", "0", "--timeout", "5"],
            capture_output=True,
            text=True,
            timeout=120,
            env={**os.environ, "DFLASH_DEBUG": ""},
        )
    finally:
        stop()
    assert proc.returncode == 1, proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "bad HTTP status line" in errors[0] and "sample p/1" in errors[0]


def test_timeout_is_documented_with_its_default():
    res = CliRunner().invoke(create_app(), ["bench", "--help"], env={"COLUMNS": "200"})
    assert res.exit_code == 0 and "--timeout" in res.stdout and "default 600" in res.stdout
    assert "whole request" in res.stdout
