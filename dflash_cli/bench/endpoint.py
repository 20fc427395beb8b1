"""`dflash bench --endpoint URL`: the same datasets and report against any OpenAI-compatible server.

Requests go one at a time to `/v1/chat/completions` with `stream: true` (each turn of a sample
after the earlier turns and the server's replies), timed by the client: TTFT to the first text
chunk, TPOT = (last chunk - first chunk) / (completion tokens - 1). Acceptance comes from the
server's Prometheus `/metrics` spec-decode counters (vLLM's names: vLLM, SGLang with them, and
`dflash serve`), read before and after each request; without them it is reported as unavailable.
With a recipe as well, greedy runs compare the server's text with plain decoding of that recipe.
"""

from __future__ import annotations

import http.client
import json
import re
import time
from collections.abc import Callable
from typing import Any
from urllib.parse import urlsplit

from dflash_cli.bench.datasets import Sample
from dflash_cli.bench.spread import spread
from dflash_cli.bench.vllm_fields import latency_fields
from dflash_cli.decoding.result import GenerationResult
from dflash_cli.errors import DFlashError

_SAMPLE = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*)(\{[^}]*\})?\s+(\S+)$")
_COUNTERS = {
    "drafts": "vllm:spec_decode_num_drafts_total",
    "draft_tokens": "vllm:spec_decode_num_draft_tokens_total",
    "accepted": "vllm:spec_decode_num_accepted_tokens_total",
}
_PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos_total"


class Endpoint:
    """A small client for one OpenAI-compatible server (standard library only)."""

    def __init__(self, url: str, timeout: float = 600.0) -> None:
        parts = urlsplit(url if "://" in url else f"http://{url}")
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise DFlashError(f"not an http(s) URL: {url!r}", hint="e.g. --endpoint http://127.0.0.1:8000")
        self.url, self.timeout = url, timeout
        self.https = parts.scheme == "https"
        self.host, self.port = parts.hostname, parts.port or (443 if self.https else 80)
        self.prefix = parts.path.rstrip("/").removesuffix("/v1")

    def _conn(self) -> http.client.HTTPConnection:
        cls = http.client.HTTPSConnection if self.https else http.client.HTTPConnection
        return cls(self.host, self.port, timeout=self.timeout)

    def get(self, path: str) -> tuple[int, bytes]:
        conn = self._conn()
        try:
            conn.request("GET", self.prefix + path)
            res = conn.getresponse()
            return res.status, res.read()
        except OSError as exc:
            raise DFlashError(
                f"cannot reach {self.url}: {exc}", hint="start the server first (e.g. `dflash serve`)"
            ) from None
        finally:
            conn.close()

    def model(self) -> str:
        status, body = self.get("/v1/models")
        try:
            return json.loads(body)["data"][0]["id"]
        except (ValueError, KeyError, IndexError, TypeError):
            raise DFlashError(
                f"{self.url}/v1/models answered {status} without a model", hint="pass --model NAME"
            ) from None

    def counters(self) -> dict[str, Any] | None:
        """The server's spec-decode counters (summed over label sets), or None without them."""
        status, body = self.get("/metrics")
        if status != 200:
            return None
        found: dict[str, float] = {}
        per_pos: dict[int, float] = {}
        for line in body.decode(errors="replace").splitlines():
            m = _SAMPLE.match(line.strip())
            if not m:
                continue
            name, labels, value = m.group(1), m.group(2) or "", float(m.group(3))
            for key, metric in _COUNTERS.items():
                if name == metric:
                    found[key] = found.get(key, 0.0) + value
            if name == _PER_POS:
                pos = re.search(r'position="(\d+)"', labels)
                if pos:
                    per_pos[int(pos.group(1))] = per_pos.get(int(pos.group(1)), 0.0) + value
        if "drafts" not in found or "accepted" not in found:
            return None
        return {**found, "per_pos": [per_pos[i] for i in sorted(per_pos)]}

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
        conn = self._conn()
        t0 = time.perf_counter()
        try:
            conn.request(
                "POST", self.prefix + "/v1/chat/completions", json.dumps(body), {"content-type": "application/json"}
            )
            res = conn.getresponse()
            if res.status != 200:
                detail = res.read().decode(errors="replace")[:300]
                raise DFlashError(
                    f"{self.url} answered {res.status}: {detail}", hint="check --model and the server log"
                )
            first = last = None
            text, usage = [], None
            for raw in res:
                if not raw.startswith(b"data: "):
                    continue
                data = raw[6:].strip()
                if data == b"[DONE]":
                    break
                doc = json.loads(data)
                if "error" in doc:
                    raise DFlashError(f"{self.url} failed mid-stream: {doc['error'].get('message')}")
                usage = doc.get("usage") or usage
                for choice in doc.get("choices") or []:
                    piece = (choice.get("delta") or {}).get("content")
                    if piece:
                        last = time.perf_counter()
                        first = first if first is not None else last
                        text.append(piece)
        except OSError as exc:
            raise DFlashError(f"request to {self.url} failed: {exc}", hint="is the server still running?") from None
        finally:
            conn.close()
        end = time.perf_counter()
        return {"text": "".join(text), "t0": t0, "first": first, "last": last, "end": end, "usage": usage or {}}


def as_result(reply: dict[str, Any], chunks_fallback: int) -> GenerationResult:
    """A GenerationResult with the client's timings (tokens are placeholders: only their count is known)."""
    tokens = int(reply["usage"].get("completion_tokens") or chunks_fallback)
    first = reply["first"] if reply["first"] is not None else reply["end"]
    last = reply["last"] if reply["last"] is not None else first
    return GenerationResult(
        mode="endpoint",
        prompt_tokens=int(reply["usage"].get("prompt_tokens") or 0),
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
    for sample in samples[: settings.warmup]:
        client.chat(model, [{"role": "user", "content": sample.turns[0]}], settings, settings.seed)
    results: list[GenerationResult] = []
    deltas: list[dict[str, Any]] = []
    mismatches: list[dict[str, Any]] = []
    total, done = sum(len(s.turns) for s in samples) * settings.repeat, 0
    for sample in samples:
        messages: list[dict] = []
        for turn, user in enumerate(sample.turns):
            messages.append({"role": "user", "content": user})
            reply_text = None
            for rep in range(settings.repeat):
                before = client.counters()
                reply = client.chat(model, messages, settings, settings.seed)
                after = client.counters()
                results.append(as_result(reply, chunks_fallback=0))
                if before is not None and after is not None:
                    deltas.append(_delta(before, after))
                if rep == 0:
                    reply_text = reply["text"]
                    if plain_text is not None and settings.temperature == 0:
                        want = plain_text(list(messages))
                        if want != reply["text"]:
                            mismatches.append(_text_mismatch(sample.id, turn, want, reply["text"]))
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
    section.update(_acceptance(deltas))
    lossless = {"checked": plain_text is not None and settings.temperature == 0, "mismatches": mismatches}
    return {"endpoint": section, "lossless": lossless}


def _text_mismatch(sample_id: str, turn: int, want: str, got: str) -> dict[str, Any]:
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


def _delta(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    width = max(len(before["per_pos"]), len(after["per_pos"]))
    b = before["per_pos"] + [0.0] * (width - len(before["per_pos"]))
    a = after["per_pos"] + [0.0] * (width - len(after["per_pos"]))
    out = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in _COUNTERS}
    out["per_pos"] = [x - y for x, y in zip(a, b)]
    return out


def _acceptance(deltas: list[dict[str, Any]]) -> dict[str, Any]:
    if not deltas:
        return {"spec_decode": "unavailable: the server exposes no vLLM-named spec-decode counters on /metrics"}
    drafts = sum(d["drafts"] for d in deltas)
    accepted = sum(d["accepted"] for d in deltas)
    draft_tokens = sum(d["draft_tokens"] for d in deltas)
    width = max(len(d["per_pos"]) for d in deltas)
    per_pos = [sum(d["per_pos"][i] for d in deltas if i < len(d["per_pos"])) for i in range(width)]
    return {
        "spec_decode_num_drafts": int(drafts),
        "spec_decode_draft_tokens": int(draft_tokens),
        "spec_decode_accepted_tokens": int(accepted),
        "spec_decode_acceptance_length": 1 + accepted / drafts if drafts else None,
        "spec_decode_acceptance_rate": accepted / draft_tokens if draft_tokens else None,
        "spec_decode_per_position_acceptance_rates": [p / drafts for p in per_pos] if drafts else None,
        "mean_acceptance_length": 1 + accepted / drafts if drafts else None,
    }
