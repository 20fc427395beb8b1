"""A hostile load on `dflash serve`: N clients for S seconds (half streamed, a tenth disconnecting
early, a few oversized or malformed), then the latency of a normal request while oversized ones are
being refused, against its idle latency.

    .venv/bin/python benchmarks/serve_hostile_load.py --recipe demo [--clients 16] [--seconds 60] [--src DIR]

Every 200 is checked complete (a finish reason; streams end with [DONE]) and token-for-token equal
to `dflash run --json` on the same prompt (greedy). `--src DIR` runs the server from another
checkout (e.g. an old revision's worktree) with this venv, for before/after runs. Exit 1 if any
request was lost, hung, incomplete or different.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import re
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from urllib.parse import urlsplit

PROMPTS = [
    "def fibonacci(n):",
    "class Stack:",
    "import os\n",
    "for i in range(10):",
    "def add(a, b):",
    "x = [",
    "def parse(text):",
    "while True:",
]
LONGEST = 64  # max_tokens drawn from 8..LONGEST; greedy answers are prefixes of the longest one
HUNG_S = 120.0  # a request without an answer after this long is hung


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--recipe", default="demo")
    ap.add_argument("--cache-dir", default=None)
    ap.add_argument("--clients", type=int, default=16)
    ap.add_argument("--seconds", type=float, default=60.0, help="the load's length (0: latency only)")
    ap.add_argument("--latency-requests", type=int, default=20, help="normal requests timed idle and busy")
    ap.add_argument("--src", default=None, help="run dflash from this checkout (PYTHONPATH)")
    ap.add_argument("--oversized-mb", type=float, default=10.0)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if args.src:
        env["PYTHONPATH"] = str(Path(args.src).resolve())
    base = [sys.executable, "-m", "dflash_cli"]
    common = ["-r", args.recipe] + (["--cache-dir", args.cache_dir] if args.cache_dir else [])

    want = {p: _run_json(base, common, env, p) for p in PROMPTS}
    proc = subprocess.Popen(
        [*base, "serve", *common, "--port", "0", "--queue-size", str(2 * args.clients)],
        stderr=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        text=True,
        env=env,
    )
    try:
        url = _wait_for_url(proc)
        big = b'{"prompt": "' + b"x" * int(args.oversized_mb * 2**20) + b'"}'
        print(f"server {url}; {args.clients} clients for {args.seconds:.0f} s", flush=True)
        decode = _decoder(args.recipe)
        ok = True
        if args.seconds > 0:
            records = _load(url, want, decode, args.clients, args.seconds, big, random.Random(args.seed))
            ok = _report_load(records)
        idle = [_timed_normal(url) for _ in range(args.latency_requests)]
        busy = _during_oversized(url, big, args.latency_requests)
        ok &= _report_latency(idle, busy)
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
    return 0 if ok else 1


def _run_json(base: list[str], common: list[str], env: dict, prompt: str) -> list[int]:
    out = subprocess.run(
        [*base, "run", *common, "--json", "-p", prompt, "--max-new-tokens", str(LONGEST)],
        capture_output=True,
        text=True,
        env=env,
        check=True,
    )
    return json.loads(out.stdout)["token_ids"]


def _decoder(recipe: str) -> Callable[[list[int]], str]:
    """The target's tokenizer, to decode the expected tokens the way the server streams them."""
    from transformers import AutoTokenizer

    from dflash_cli.checkpoints.locate import resolve_checkpoint_dir
    from dflash_cli.recipe.schema import load_recipe

    tok = AutoTokenizer.from_pretrained(str(resolve_checkpoint_dir(load_recipe(recipe).target.path, "target")))
    return lambda ids: tok.decode(ids, skip_special_tokens=True)


def _wait_for_url(proc: subprocess.Popen) -> str:
    line = ""
    while "serving" not in line:
        line = proc.stderr.readline()
        if not line and proc.poll() is not None:
            raise SystemExit("the server exited before listening")
    threading.Thread(target=proc.stderr.read, daemon=True).start()  # keep its pipe drained
    return re.search(r"http://\S+/v1", line).group(0).removesuffix("/v1")


# --- one request --------------------------------------------------------------------------------
def _post(url: str, path: str, body: bytes, *, stream: bool = False, leave_after: float | None = None) -> dict:
    """One request; returns status, seconds, and for a 200 the token ids and whether it completed."""
    parts = urlsplit(url)
    start = time.monotonic()
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=HUNG_S)
    rec: dict = {"status": None, "complete": False, "tokens": None}
    try:
        conn.request("POST", path, body, {"content-type": "application/json"})
        if leave_after is not None:
            time.sleep(leave_after)
            conn.sock.shutdown(socket.SHUT_RDWR)
            rec["status"] = "left"
            return rec
        res = conn.getresponse()
        rec["status"] = res.status
        if res.status != 200:
            res.read()
            return rec
        if not stream:
            doc = json.loads(res.read())
            choice = doc["choices"][0]
            rec["tokens"], rec["complete"] = choice.get("token_ids"), choice["finish_reason"] in ("stop", "length")
            return rec
        texts, reason, done = [], None, False
        for raw in res:
            if not raw.startswith(b"data: "):
                continue
            data = raw[6:].strip()
            if data == b"[DONE]":
                done = True
                break
            event = json.loads(data)
            for c in event.get("choices", []):
                texts.append(c.get("text") or "")
                reason = c.get("finish_reason") or reason
        rec["text"], rec["complete"] = "".join(texts), done and reason in ("stop", "length")
        return rec
    except (OSError, http.client.HTTPException, ValueError) as exc:
        rec["status"] = "hung" if isinstance(exc, TimeoutError) else f"lost: {type(exc).__name__}"
        return rec
    finally:
        rec["seconds"] = time.monotonic() - start
        conn.close()


def _normal_body(prompt: str, max_tokens: int, stream: bool) -> bytes:
    body = {"prompt": prompt, "max_tokens": max_tokens, "return_token_ids": True, "stream": stream}
    return json.dumps(body).encode()


# --- the load ---------------------------------------------------------------------------------
def _load(
    url: str, want: dict, decode: Callable, clients: int, seconds: float, big: bytes, rng: random.Random
) -> list[dict]:
    records: list[dict] = []
    lock = threading.Lock()
    deadline = time.monotonic() + seconds
    seeds = [rng.randrange(1 << 30) for _ in range(clients)]

    def client(seed: int) -> None:
        r = random.Random(seed)
        while time.monotonic() < deadline:
            roll = r.random()
            prompt, n = r.choice(PROMPTS), r.randint(8, LONGEST)
            if roll < 0.04:
                kind, path, body = "oversized", "/v1/completions", big
                rec = _post(url, path, body)
            elif roll < 0.08:
                kind = "malformed"
                body = r.choice([b"{not json", b'{"prompt": "a\\ud800"}', b"[" * 100_000, b'{"prompt": 3}'])
                rec = _post(url, "/v1/completions", body)
            elif roll < 0.18:
                kind = "disconnect"
                rec = _post(url, "/v1/completions", _normal_body(prompt, n, r.random() < 0.5), leave_after=0.05)
            else:
                stream = roll < 0.59
                kind = "streamed" if stream else "whole"
                rec = _post(url, "/v1/completions", _normal_body(prompt, n, stream), stream=stream)
                if rec["status"] == 200:  # greedy: a shorter answer is a prefix of the longest one
                    expect = want[prompt][:n]
                    rec["same"] = rec["text"] == decode(expect) if stream else rec["tokens"] == expect
            rec["kind"] = kind
            with lock:
                records.append(rec)

    threads = [threading.Thread(target=client, args=(s,)) for s in seeds]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return records


def _report_load(records: list[dict]) -> bool:
    kinds = sorted({r["kind"] for r in records})
    print(f"\n{'kind':<11}{'requests':>9}  statuses")
    for k in kinds:
        rs = [r for r in records if r["kind"] == k]
        counts: dict = {}
        for r in rs:
            counts[r["status"]] = counts.get(r["status"], 0) + 1
        print(f"{k:<11}{len(rs):>9}  " + ", ".join(f"{s}: {n}" for s, n in sorted(counts.items(), key=str)))
    lost = [r for r in records if isinstance(r["status"], str) and r["status"].startswith("lost")]
    hung = [r for r in records if r["status"] == "hung"]
    ok200 = [r for r in records if r["status"] == 200]
    incomplete = [r for r in ok200 if not r["complete"]]
    different = [r for r in ok200 if r.get("same") is False]
    wrong_status = [
        r
        for r in records
        if (r["kind"] == "oversized" and r["status"] != 413) or (r["kind"] == "malformed" and r["status"] != 400)
    ]
    checked = sum(1 for r in ok200 if r.get("same"))
    streamed = sum(1 for r in ok200 if r.get("same") and r["kind"] == "streamed")
    print(
        f"\nlost {len(lost)} · hung {len(hung)} · 200s {len(ok200)} (incomplete {len(incomplete)}, "
        f"different from dflash run {len(different)} of {checked + len(different)} checked, {streamed} streamed) · "
        f"oversized/malformed with the wrong status {len(wrong_status)}"
    )
    return not (lost or hung or incomplete or different or wrong_status)


# --- latency of a normal request while oversized ones are refused --------------------------------
def _timed_normal(url: str) -> float:
    rec = _post(url, "/v1/completions", _normal_body(PROMPTS[0], 16, False))
    assert rec["status"] == 200, rec
    return rec["seconds"]


def _during_oversized(url: str, big: bytes, n: int) -> list[float]:
    stop = threading.Event()
    chat_big = json.dumps({"messages": [{"role": "user", "content": "x" * len(big)}]}).encode()

    def bomber() -> None:
        while not stop.is_set():
            _post(url, "/v1/completions", big)
            _post(url, "/v1/chat/completions", chat_big)

    threads = [threading.Thread(target=bomber) for _ in range(2)]
    for t in threads:
        t.start()
    time.sleep(0.5)
    try:
        return [_timed_normal(url) for _ in range(n)]
    finally:
        stop.set()
        for t in threads:
            t.join()


def _report_latency(idle: list[float], busy: list[float]) -> bool:
    def p(xs: list[float], q: float) -> float:
        xs = sorted(xs)
        return xs[min(len(xs) - 1, int(q * len(xs)))]

    print(
        f"\nnormal request (16 tokens), {len(idle)} each: idle median {statistics.median(idle):.3f} s, "
        f"p99 {p(idle, 0.99):.3f} s; during oversized rejections median {statistics.median(busy):.3f} s, "
        f"p99 {p(busy, 0.99):.3f} s; p99 difference {p(busy, 0.99) - p(idle, 0.99):+.3f} s (bound: < 1 s)"
    )
    return p(busy, 0.99) - p(idle, 0.99) < 1.0


if __name__ == "__main__":
    sys.exit(main())
