"""Load test for `dflash serve`: the cost of serving, then N concurrent clients for T seconds.

    .venv/bin/python benchmarks/serve_load.py [--recipe demo] [--clients 4] [--duration 60]

Starts `dflash serve` as a child process on 127.0.0.1 (any free port), with HumanEval prompts:
1. Overhead, one request at a time, interleaved per prompt: the same greedy generation with the
   engine `dflash run` uses (in this process), through the server streamed (timed by the client:
   decode from the first to the last text chunk, end to end from sending to the last chunk) and
   not streamed (sending to the whole answer). Tokens / time pooled over prompts, and the ratios.
2. Load: N client threads send streamed requests back to back for T seconds (the queue holds
   --queue-size; a 503 is counted and retried after its Retry-After), then stop; requests in
   flight finish. Reports completed requests, errors, 503s, p50/p99 TTFT and TPOT, output tok/s
   and the server's spec-decode counters from /metrics.
3. Sends SIGTERM and checks the server exits 0.
It stops by itself; results go to benchmarks/results/serve/ as JSON and Markdown.
"""

from __future__ import annotations

import argparse
import http.client
import json
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from urllib.parse import urlsplit

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def stream_request(url: str, body: dict, timeout: float = 300) -> dict:
    """One streamed completion; client-side times of the first and last text chunk."""
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=timeout)
    t0 = time.perf_counter()
    conn.request(
        "POST", "/v1/completions", json.dumps({**body, "stream": True, "stream_options": {"include_usage": True}})
    )
    res = conn.getresponse()
    if res.status != 200:
        retry = float(res.getheader("Retry-After") or 1)
        detail = res.read().decode(errors="replace")
        conn.close()
        return {"status": res.status, "retry_after": retry, "detail": detail}
    first = last = None
    usage, text, ok = None, [], False
    for raw in res:
        if not raw.startswith(b"data: "):
            continue
        data = raw[6:].strip()
        if data == b"[DONE]":
            ok = True
            break
        doc = json.loads(data)
        if "error" in doc:
            break
        if doc.get("usage"):
            usage = doc["usage"]
        for c in doc.get("choices", []):
            if c.get("text"):
                now = time.perf_counter()
                first = first if first is not None else now
                last = now
                text.append(c["text"])
    conn.close()
    tokens = usage["completion_tokens"] if usage else 0
    return {
        "status": 200 if ok else 500,
        "ttft_s": (first - t0) if first is not None else None,
        "decode_s": (last - first) if first is not None else None,  # after the first token's chunk
        "done_s": (last - t0) if last is not None else None,  # request sent to last text
        "tokens": tokens,
        "text": "".join(text),
    }


def whole_request(url: str, body: dict, timeout: float = 300) -> dict:
    """One non-streamed completion: tokens and the time from sending to the whole answer."""
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=timeout)
    t0 = time.perf_counter()
    conn.request("POST", "/v1/completions", json.dumps(body))
    doc = json.loads(conn.getresponse().read())
    done = time.perf_counter() - t0
    conn.close()
    return {"tokens": doc["usage"]["completion_tokens"], "done_s": done, "text": doc["choices"][0]["text"]}


def start_server(args) -> tuple[subprocess.Popen, str]:
    cmd = [sys.executable, "-m", "dflash_cli", "serve", "-r", args.recipe, "--port", "0"]
    cmd += ["--queue-size", str(args.queue_size)] + (["--cache-dir", args.cache_dir] if args.cache_dir else [])
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    while True:
        line = proc.stderr.readline()
        if not line and proc.poll() is not None:
            raise SystemExit(f"server exited with {proc.returncode} before listening")
        sys.stderr.write(line)
        found = re.search(r"http://\S+/v1", line)
        if found:
            return proc, found.group(0)[: -len("/v1")]


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(q / 100 * (len(s) - 1))))]


def overhead(args, url: str, prompts: list[str]) -> dict:
    from dflash_cli.cache.store import Cache
    from dflash_cli.decoding.engine import Engine
    from dflash_cli.recipe.schema import load_recipe

    engine = Engine.load(load_recipe(args.recipe), Cache(Path(args.cache_dir) if args.cache_dir else None))
    rows, same = [], 0  # per prompt: (decode tokens, decode s, tokens, total s) direct, streamed, whole
    sides = ("direct", "streamed", "whole")
    for i, p in enumerate(prompts):
        # Rotate which goes first, so warm caches favour none of them.
        got = {}
        for side in sides[i % 3 :] + sides[: i % 3]:
            if side == "direct":
                r = engine.generate(engine.encode_prompt(p), max_new_tokens=args.max_tokens)
                got[side] = (r.decode_tokens, r.decode_s, r.new_tokens, r.prefill_s + r.decode_s)
                direct_text = engine.decode(r.tokens)
            elif side == "streamed":
                x = stream_request(url, {"prompt": p, "max_tokens": args.max_tokens})
                got[side] = (x["tokens"] - 1, x["decode_s"], x["tokens"], x["done_s"])
                served_text = x["text"]
            else:
                x = whole_request(url, {"prompt": p, "max_tokens": args.max_tokens})
                got[side] = (None, None, x["tokens"], x["done_s"])
        rows.append(tuple(got[side] for side in sides))
        same += direct_text == served_text
    del engine

    def rate(side: int, tokens: int, seconds: int) -> float:  # pooled over prompts: sum tokens / sum time
        return sum(row[side][tokens] for row in rows) / sum(row[side][seconds] for row in rows)

    per_prompt = [(s[2] / s[3]) / (d[2] / d[3]) for d, s, _ in rows]
    return {
        "prompts": len(prompts),
        "direct_decode_tok_s": rate(0, 0, 1),
        "served_decode_tok_s": rate(1, 0, 1),
        "served_over_direct_decode": rate(1, 0, 1) / rate(0, 0, 1),
        "direct_e2e_tok_s": rate(0, 2, 3),
        "served_e2e_tok_s": rate(1, 2, 3),
        "served_over_direct_e2e": rate(1, 2, 3) / rate(0, 2, 3),
        "served_over_direct_e2e_median_per_prompt": statistics.median(per_prompt),
        "whole_e2e_tok_s": rate(2, 2, 3),
        "whole_over_direct_e2e": rate(2, 2, 3) / rate(0, 2, 3),
        "identical_text": same,
    }


def load(args, url: str, prompts: list[str]) -> dict:
    lock = threading.Lock()
    done, rejected, errors = [], 0, 0
    stop_at = time.perf_counter() + args.duration
    counter = iter(range(10**9))

    def client() -> None:
        nonlocal rejected, errors
        while time.perf_counter() < stop_at:
            with lock:
                p = prompts[next(counter) % len(prompts)]
            r = stream_request(url, {"prompt": p, "max_tokens": args.max_tokens})
            with lock:
                if r["status"] == 200:
                    done.append(r)
                elif r["status"] == 503:
                    rejected += 1
                else:
                    errors += 1
            if r["status"] == 503:
                time.sleep(r["retry_after"])

    t0 = time.perf_counter()
    threads = [threading.Thread(target=client) for _ in range(args.clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    ttft = [r["ttft_s"] * 1000 for r in done if r["ttft_s"] is not None]
    tpot = [r["decode_s"] / (r["tokens"] - 1) * 1000 for r in done if r["decode_s"] and r["tokens"] > 1]
    tokens = sum(r["tokens"] for r in done)
    return {
        "clients": args.clients,
        "duration_s": wall,
        "completed": len(done),
        "errors": errors,
        "rejected_503": rejected,
        "p50_ttft_ms": percentile(ttft, 50),
        "p99_ttft_ms": percentile(ttft, 99),
        "p50_tpot_ms": percentile(tpot, 50),
        "p99_tpot_ms": percentile(tpot, 99),
        "output_tok_s": tokens / wall,
    }


def spec_counters(url: str) -> dict:
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=30)
    conn.request("GET", "/metrics")
    text = conn.getresponse().read().decode()
    out = {}
    for name in ("drafts", "draft_tokens", "accepted_tokens"):
        m = re.search(rf"^vllm:spec_decode_num_{name}_total{{[^}}]*}} (\S+)$", text, re.M)
        out[name] = float(m.group(1)) if m else None
    if out["drafts"]:
        out["acceptance_length"] = 1 + out["accepted_tokens"] / out["drafts"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--recipe", default="demo")
    ap.add_argument("--cache-dir", default=None)
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--duration", type=float, default=60.0)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--queue-size", type=int, default=2)
    ap.add_argument("--overhead-prompts", type=int, default=12)
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results/serve/load.json"))
    args = ap.parse_args()

    from dflash_cli.bench.datasets import load_dataset

    prompts = [s.turns[0] for s in load_dataset("humaneval")]
    proc, url = start_server(args)
    try:
        result = {
            "recipe": args.recipe,
            "max_tokens": args.max_tokens,
            "queue_size": args.queue_size,
            "overhead": overhead(args, url, prompts[: args.overhead_prompts]),
        }
        before = spec_counters(url)
        result["load"] = load(args, url, prompts)
        after = spec_counters(url)
        drafts = (after["drafts"] or 0) - (before["drafts"] or 0)
        accepted = (after["accepted_tokens"] or 0) - (before["accepted_tokens"] or 0)
        result["load"]["spec_decode_acceptance_length"] = 1 + accepted / drafts if drafts else None
    finally:
        proc.send_signal(signal.SIGTERM)
        result_code = proc.wait(120)
    result["sigterm_exit_code"] = result_code
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    o, ld = result["overhead"], result["load"]
    md = [
        f"# dflash serve, recipe {args.recipe}, {args.max_tokens} new tokens, HumanEval prompts",
        "",
        f"Overhead ({o['prompts']} prompts, one at a time, tokens / time pooled over prompts): decode tok/s "
        f"direct {o['direct_decode_tok_s']:.1f}, served {o['served_decode_tok_s']:.1f} "
        f"(ratio {o['served_over_direct_decode']:.3f}; served decode time starts at the first text chunk); "
        f"end to end (prefill, HTTP and tokenization included) direct {o['direct_e2e_tok_s']:.1f}, served "
        f"{o['served_e2e_tok_s']:.1f} (ratio {o['served_over_direct_e2e']:.3f}, median per prompt "
        f"{o['served_over_direct_e2e_median_per_prompt']:.3f}); not streamed, end to end "
        f"{o['whole_e2e_tok_s']:.1f} (ratio {o['whole_over_direct_e2e']:.3f}); "
        f"identical text on {o['identical_text']}/{o['prompts']}.",
        "",
        "| clients | s | completed | errors | 503 | p50 TTFT ms | p99 TTFT ms | p50 TPOT ms | p99 TPOT ms "
        "| out tok/s | tau |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
        f"| {ld['clients']} | {ld['duration_s']:.0f} | {ld['completed']} | {ld['errors']} | {ld['rejected_503']} | "
        f"{ld['p50_ttft_ms']:.0f} | {ld['p99_ttft_ms']:.0f} | {ld['p50_tpot_ms']:.1f} | {ld['p99_tpot_ms']:.1f} | "
        f"{ld['output_tok_s']:.1f} | {ld['spec_decode_acceptance_length'] or float('nan'):.2f} |",
        "",
        f"SIGTERM: exit code {result_code}.",
    ]
    out.with_suffix(".md").write_text("\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()
