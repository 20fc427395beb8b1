"""The bench report as Markdown or CSV: one row per mode with the headline numbers and their spread."""

from __future__ import annotations

import csv
import io
from typing import Any

from dflash_cli.bench.document import MODE_SECTIONS

COLUMNS = (
    "mode",
    "decode_tok_s",
    "tpot_ms_median",
    "tpot_ms_p99",
    "tpot_ms_std",
    "ttft_ms_median",
    "ttft_ms_p99",
    "tau",
    "acceptance_rate",
    "speedup",
    "speedup_ci95_low",
    "speedup_ci95_high",
    "completed",
)


def mode_rows(doc: dict[str, Any]) -> list[dict[str, Any]]:
    rows = []
    for key, label in MODE_SECTIONS:
        s = doc.get(key)
        if not s:
            continue
        boot = s.get("decode_speedup_bootstrap") or {}
        ci = boot.get("ci95") or [None, None]
        tpot, ttft = s.get("tpot_ms_spread") or {}, s.get("ttft_ms_spread") or {}
        rows.append(
            {
                "mode": label,
                "decode_tok_s": s.get("decode_tokens_per_s"),
                "tpot_ms_median": tpot.get("median"),
                "tpot_ms_p99": tpot.get("p99"),
                "tpot_ms_std": tpot.get("std"),
                "ttft_ms_median": ttft.get("median"),
                "ttft_ms_p99": ttft.get("p99"),
                "tau": s.get("mean_acceptance_length"),
                "acceptance_rate": s.get("spec_decode_acceptance_rate"),
                "speedup": 1.0 if key == "baseline" else s.get("decode_speedup"),
                "speedup_ci95_low": ci[0],
                "speedup_ci95_high": ci[1],
                "completed": s.get("completed"),
            }
        )
    return rows


def to_csv(doc: dict[str, Any]) -> str:
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=COLUMNS, lineterminator="\n")
    writer.writeheader()
    for row in mode_rows(doc):
        writer.writerow({k: "" if v is None else v for k, v in row.items()})
    return out.getvalue()


def _fmt(value: Any, digits: int = 2) -> str:
    if value is None:
        return "—"
    return f"{value:.{digits}f}" if isinstance(value, float) else str(value)


def to_markdown(doc: dict[str, Any]) -> str:
    settings, dataset = doc.get("settings", {}), doc.get("dataset", {})
    title = (
        f"dflash bench — {settings.get('recipe')} on {dataset.get('name')} ({dataset.get('n_samples')} samples, "
        f"block {settings.get('block_size')}, repeat {settings.get('repeat', 1)}, "
        f"temperature {settings.get('temperature')})"
    )
    lines = [
        f"**{title}**",
        "",
        "| mode | decode tok/s | TPOT ms median | TPOT ms p99 | TPOT ms std | TTFT ms median | tau | speedup "
        "| 95% CI |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for r in mode_rows(doc):
        ci = (
            f"[{r['speedup_ci95_low']:.2f}, {r['speedup_ci95_high']:.2f}]" if r["speedup_ci95_low"] is not None else "—"
        )
        lines.append(
            f"| {r['mode']} | {_fmt(r['decode_tok_s'], 1)} | {_fmt(r['tpot_ms_median'])} | {_fmt(r['tpot_ms_p99'])} "
            f"| {_fmt(r['tpot_ms_std'])} | {_fmt(r['ttft_ms_median'], 1)} | {_fmt(r['tau'])} "
            f"| {_fmt(r['speedup'])}x | {ci} |"
        )
    plain_on = (doc.get("environment") or {}).get("plain_session")
    if plain_on and doc.get("baseline"):
        lines += ["", f"plain ran on {plain_on}"]
    lossless = doc.get("lossless", {})
    if lossless.get("checked"):
        n = len(lossless.get("mismatches", []))
        lines += ["", "lossless: every output matched plain greedy" if n == 0 else f"lossless: {n} mismatch(es)"]
    return "\n".join(lines) + "\n"
