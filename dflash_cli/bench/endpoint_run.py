"""`dflash bench --endpoint`'s run over a dataset: each turn of each sample (repeated) sent one at a time through
an Endpoint (bench/endpoint.py), timed by the client, the server's spec-decode counters read around each request
(bench/spec_counters.py), and with a recipe, greedy text compared with the recipe's own plain decoding."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

from dflash_cli.bench.datasets import Sample
from dflash_cli.bench.endpoint import Endpoint
from dflash_cli.bench.spec_counters import NO_COUNTERS, acceptance, delta
from dflash_cli.bench.spread import spread
from dflash_cli.bench.vllm_fields import latency_fields
from dflash_cli.decoding.result import GenerationResult
from dflash_cli.errors import EndpointError


def as_result(reply: dict[str, Any]) -> GenerationResult:
    """A GenerationResult with the client's timings (tokens are placeholders: only their count is known)."""
    tokens = int(reply["usage"]["completion_tokens"])
    prompt_tokens = reply["usage"].get("prompt_tokens")
    first = reply["first"] if reply["first"] is not None else reply["end"]
    last = reply["last"] if reply["last"] is not None else first
    return GenerationResult(
        mode="endpoint",
        prompt_tokens=prompt_tokens if isinstance(prompt_tokens, int) else 0,
        tokens=[0] * tokens,
        prefill_s=first - reply["t0"],
        decode_s=max(0.0, last - first),
    )


def run_endpoint(
    client: Endpoint,
    model: str,
    samples: list[Sample],
    settings: Any,
    *,
    plain_text: Callable[[list[dict]], str] | None = None,
    on_progress: Callable[[int, int], None] | None = None,
) -> dict[str, Any]:
    """Every turn of every sample (repeated), one request at a time; returns the endpoint section."""
    for i, sample in enumerate(samples[: settings.warmup]):
        with _naming(f"warmup request {i + 1}/{min(settings.warmup, len(samples))} (sample {sample.id})"):
            client.chat(model, [{"role": "user", "content": sample.turns[0]}], settings, settings.seed)
    results: list[GenerationResult] = []
    deltas: list[dict[str, Any]] = []
    unusable: str | None = None  # why the counters cannot give acceptance, once they cannot
    mismatches: list[dict[str, Any]] = []
    total, done = sum(len(s.turns) for s in samples) * settings.repeat, 0
    for sample in samples:
        messages: list[dict] = []
        for turn, user in enumerate(sample.turns):
            messages.append({"role": "user", "content": user})
            reply_text = None
            for rep in range(settings.repeat):
                where = f"request {done + 1}/{total} (sample {sample.id}, turn {turn + 1}"
                where += f", repeat {rep + 1})" if settings.repeat > 1 else ")"
                with _naming(where):
                    before = client.counters()
                    reply = client.chat(model, messages, settings, settings.seed)
                    after = client.counters()
                results.append(as_result(reply))
                if isinstance(before, dict) and isinstance(after, dict):
                    moved = delta(before, after)
                    deltas.append(moved)
                    if min(moved["drafts"], moved["draft_tokens"], moved["accepted"], *moved["per_pos"]) < 0:
                        # A restarted server (or no counters at all): negative deltas made tau 4.00 of nothing.
                        why = f"the spec-decode counters on /metrics went backwards over {where}"
                        unusable = unusable or why + " (was the server restarted?)"
                else:
                    unusable = unusable or next((c for c in (before, after) if c != NO_COUNTERS), None)
                if rep == 0:
                    reply_text = reply["text"]
                    if plain_text is not None and settings.temperature == 0:
                        want = plain_text(list(messages))
                        if want != reply["text"]:
                            mismatches.append(text_mismatch(sample.id, turn, want, reply["text"]))
                done += 1
                if on_progress is not None:
                    on_progress(done, total)
            messages.append({"role": "assistant", "content": reply_text or ""})
    section: dict[str, Any] = {
        **latency_fields(results),
        "decode_tokens_per_s": sum(r.decode_tokens for r in results) / sum(r.decode_s for r in results)
        if sum(r.decode_s for r in results) > 0
        else 0.0,
        "ttft_ms_spread": spread([r.prefill_s * 1000 for r in results]),
        "tpot_ms_spread": spread([r.time_per_output_token * 1000 for r in results if r.decode_tokens]),
        "decode_tokens_per_s_spread": spread([r.decode_tokens_per_s for r in results if r.decode_tokens]),
        "new_tokens": sum(r.new_tokens for r in results),
    }
    section.update(acceptance(deltas) if unusable is None else {"spec_decode": f"unavailable: {unusable}"})
    lossless = {"checked": plain_text is not None and settings.temperature == 0, "mismatches": mismatches}
    return {"endpoint": section, "lossless": lossless}


@contextlib.contextmanager
def _naming(where: str) -> Iterator[None]:
    """Prefix a server fault with the request it happened on."""
    try:
        yield
    except EndpointError as err:
        err.message = f"{where}: {err.message}"
        err.args = (err.message,)
        raise


def text_mismatch(sample_id: str, turn: int, want: str, got: str) -> dict[str, Any]:
    """Where the server's text first left the local plain decoding's (the server gives text, not ids)."""
    at = next((i for i, (x, y) in enumerate(zip(want, got)) if x != y), min(len(want), len(got)))
    return {
        "sample_id": sample_id,
        "turn": turn,
        "mode": "endpoint",
        "unit": "character",
        "position": at,
        "expected": repr(want[at : at + 20]),
        "got": repr(got[at : at + 20]),
    }
