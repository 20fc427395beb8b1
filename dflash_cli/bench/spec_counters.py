"""A server's speculative-decoding counters on Prometheus `/metrics` (vLLM's names; SGLang and `dflash serve`
expose the same), and the acceptance they give over a run: summed per request from before/after deltas.

A counter that is not a finite count >= 0, or one that goes backwards (a restarted server), gives no number:
the caller reports acceptance as unavailable, with the reason these functions return.
"""

from __future__ import annotations

import math
import re
from typing import Any

_SAMPLE = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*)(\{[^}]*\})?\s+(\S+)$")
_COUNTERS = {
    "drafts": "vllm:spec_decode_num_drafts_total",
    "draft_tokens": "vllm:spec_decode_num_draft_tokens_total",
    "accepted": "vllm:spec_decode_num_accepted_tokens_total",
}
_PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos_total"
NO_COUNTERS = "the server exposes no vLLM-named spec-decode counters on /metrics"


def parse_counters(text: str) -> dict[str, Any] | str:
    """The spec-decode counters of a /metrics body (summed over label sets), or why there are none to use."""
    found: dict[str, float] = {}
    per_pos: dict[int, float] = {}
    for line in text.splitlines():
        m = _SAMPLE.match(line.strip())
        if not m:
            continue
        name, labels, value_text = m.group(1), m.group(2) or "", m.group(3)
        if name not in (*_COUNTERS.values(), _PER_POS):
            continue  # other metrics may be anything (a gauge may well be NaN)
        try:
            value = float(value_text)
        except ValueError:
            value = math.nan
        if not math.isfinite(value) or value < 0:  # NaN, inf or negative: no count to subtract
            return f"/metrics gave {name}{labels} = {value_text[:40]}, not a finite count >= 0"
        for key, metric in _COUNTERS.items():
            if name == metric:
                found[key] = found.get(key, 0.0) + value
        if name == _PER_POS:
            pos = re.search(r'position="(\d+)"', labels)
            if pos:
                per_pos[int(pos.group(1))] = per_pos.get(int(pos.group(1)), 0.0) + value
    if "drafts" not in found or "accepted" not in found:
        return NO_COUNTERS
    return {**found, "per_pos": [per_pos[i] for i in sorted(per_pos)]}


def delta(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    width = max(len(before["per_pos"]), len(after["per_pos"]))
    b = before["per_pos"] + [0.0] * (width - len(before["per_pos"]))
    a = after["per_pos"] + [0.0] * (width - len(after["per_pos"]))
    out = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in _COUNTERS}
    out["per_pos"] = [x - y for x, y in zip(a, b)]
    return out


def acceptance(deltas: list[dict[str, Any]]) -> dict[str, Any]:
    if not deltas:
        return {"spec_decode": f"unavailable: {NO_COUNTERS}"}
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
