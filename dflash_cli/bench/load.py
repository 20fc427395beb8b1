"""`dflash bench --endpoint URL --concurrency N [--request-rate R]`: a server under load, as `vllm bench serve`
measures it (its field names, so its dashboards and scripts read ours).

Each sample's first turn is one request (times --repeat). Requests arrive at once, or as a Poisson process
of R requests per second (seeded: the same arrival times every run), and at most N are in flight. Every
request streams; its time to first token, time per output token after the first, and end-to-end latency
are the client's own clock.
"""

from __future__ import annotations

import math
import random
import statistics
import threading
import time
from collections.abc import Callable
from typing import Any

from dflash_cli.bench.endpoint import Endpoint, EndpointError


def arrival_times(n: int, request_rate: float, seed: int) -> list[float]:
    """Seconds after the start at which each request is sent: all at 0, or exponential gaps of mean 1/rate."""
    if math.isinf(request_rate):
        return [0.0] * n
    rng, t, out = random.Random(seed), 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(request_rate)
    return out


def _stats(name: str, values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    ordered = sorted(values)
    p99 = ordered[min(len(ordered) - 1, math.ceil(0.99 * len(ordered)) - 1)]
    return {
        f"mean_{name}_ms": statistics.fmean(values),
        f"median_{name}_ms": statistics.median(values),
        f"std_{name}_ms": statistics.pstdev(values),
        f"p99_{name}_ms": p99,
    }


def run_load(
    client: Endpoint,
    model: str,
    samples: list,
    settings: Any,
    concurrency: int,
    request_rate: float = math.inf,
    *,
    on_progress: Callable[[int, int], None] | None = None,
) -> dict[str, Any]:
    """The load section: vLLM's summary fields, plus each request's text (for the lossless check)."""
    work = [s for s in samples for _ in range(settings.repeat)]
    when = arrival_times(len(work), request_rate, settings.seed)
    replies: list[dict | None] = [None] * len(work)
    failures: list[str] = []
    lock, next_index = threading.Lock(), [0]
    start = time.perf_counter()

    def worker() -> None:
        while True:
            with lock:
                k = next_index[0]
                next_index[0] += 1
            if k >= len(work):
                return
            time.sleep(max(0.0, start + when[k] - time.perf_counter()))
            messages = [{"role": "user", "content": work[k].turns[0]}]
            try:
                replies[k] = client.chat(model, messages, settings, settings.seed)
            except EndpointError as err:
                with lock:
                    failures.append(f"request {k + 1} (sample {work[k].id}): {err.message}")
            if on_progress is not None:
                with lock:
                    on_progress(sum(r is not None for r in replies) + len(failures), len(work))

    threads = [threading.Thread(target=worker, daemon=True) for _ in range(min(concurrency, len(work)))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    duration = time.perf_counter() - start
    done = [r for r in replies if r is not None]
    out_tokens = [int(r["usage"]["completion_tokens"]) for r in done]
    in_tokens = [int(r["usage"].get("prompt_tokens") or 0) for r in done]
    ttft = [((r["first"] or r["end"]) - r["t0"]) * 1000 for r in done]
    tpot = [
        (r["last"] - r["first"]) * 1000 / (n - 1)
        for r, n in zip(done, out_tokens)
        if n > 1 and r["first"] is not None and r["last"] is not None
    ]
    e2el = [(r["end"] - r["t0"]) * 1000 for r in done]
    return {
        "max_concurrency": concurrency,
        "request_rate": "inf" if math.isinf(request_rate) else request_rate,
        "completed": len(done),
        "failed": len(failures),
        "failures": failures[:10],
        "duration": duration,
        "total_input_tokens": sum(in_tokens),
        "total_output_tokens": sum(out_tokens),
        "request_throughput": len(done) / duration,
        "output_throughput": sum(out_tokens) / duration,
        "total_token_throughput": (sum(in_tokens) + sum(out_tokens)) / duration,
        **_stats("ttft", ttft),
        **_stats("tpot", tpot),
        **_stats("e2el", e2el),
        "texts": [None if r is None else r["text"] for r in replies],
        "sample_ids": [s.id for s in work],
    }
