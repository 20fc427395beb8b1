"""`dflash bench compare A.json B.json ...`: headline numbers side by side, ratios to the first run,
and whether each difference is larger than the runs' own spread.

"Outside the spread" means: for a speedup, the runs' 95% bootstrap intervals do not overlap; for a
per-generation timing, the difference of the means exceeds 1.96 standard errors of the difference
(std / sqrt(n) of each run). Tau has no spread in one run, so it is never called out.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from dflash_cli.bench.document import check_document, upgrade_document
from dflash_cli.decoding.modes import MODES_INFO
from dflash_cli.errors import DFlashError

# (label, mode section, value key, spread kind): "ci" = the mode's bootstrap interval, "se" = *_spread stats.
# DFlash in detail, then every other speculative mode's speedup.
HEADLINE = (
    ("plain decode tok/s", "baseline", "decode_tokens_per_s", ("se", "decode_tokens_per_s_spread")),
    ("dflash decode tok/s", "dflash", "decode_tokens_per_s", ("se", "decode_tokens_per_s_spread")),
    ("dflash speedup", "dflash", "decode_speedup", ("ci", None)),
    ("dflash tau", "dflash", "mean_acceptance_length", None),
    ("dflash TPOT ms (mean)", "dflash", "mean_tpot_ms", ("se", "tpot_ms_spread")),
    ("dflash TTFT ms (mean)", "dflash", "mean_ttft_ms", ("se", "ttft_ms_spread")),
    *(
        (f"{m.label} speedup", m.name, "decode_speedup", ("ci", None))
        for m in MODES_INFO
        if m.speculative and m.name != "dflash"
    ),
)


def load_documents(paths: list[Path]) -> list[dict[str, Any]]:
    if len(paths) < 2:
        raise DFlashError("bench compare needs at least two JSON documents", hint="dflash bench compare A.json B.json")
    docs = []
    hint = "pass documents written by `dflash bench --output`"
    for path in paths:
        try:
            doc = json.loads(Path(path).read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise DFlashError(f"no such file: {path}", hint=hint) from None
        except (OSError, ValueError) as exc:
            raise DFlashError(f"cannot read {path} as JSON: {exc}", hint=hint) from None
        check_document(doc, str(path))
        docs.append(upgrade_document(doc))  # a schema-1 document names lookup "pld"
    return docs


def compare(docs: list[dict[str, Any]], names: list[str]) -> dict[str, Any]:
    rows = []
    for label, mode, key, kind in HEADLINE:
        sections = [d.get(mode) or {} for d in docs]
        values = [s.get(key) for s in sections]
        if all(v is None for v in values):
            continue
        base = values[0]
        ratios = [v / base if v is not None and base else None for v in values]
        outside = [None] + [_outside(kind, sections[0], s, key) for s in sections[1:]]
        rows.append({"metric": label, "values": values, "ratios": ratios, "outside_spread": outside})
    return {"runs": names, "rows": rows}


def _outside(kind, a: dict[str, Any], b: dict[str, Any], key: str) -> bool | None:
    if kind is None or a.get(key) is None or b.get(key) is None:
        return None
    if kind[0] == "ci":
        ia = (a.get("decode_speedup_bootstrap") or {}).get("ci95")
        ib = (b.get("decode_speedup_bootstrap") or {}).get("ci95")
        if not ia or not ib:
            return None
        return ia[1] < ib[0] or ib[1] < ia[0]
    sa, sb = a.get(kind[1]) or {}, b.get(kind[1]) or {}
    if not sa.get("n") or not sb.get("n") or sa.get("std") is None or sb.get("std") is None:
        return None
    se = math.sqrt(sa["std"] ** 2 / sa["n"] + sb["std"] ** 2 / sb["n"])
    return abs(sa["mean"] - sb["mean"]) > 1.96 * se if se > 0 else sa["mean"] != sb["mean"]


def render_rows(table: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    """Header and cells for a terminal or Markdown table."""
    runs = table["runs"]
    header = ["metric", *runs, *[f"{r} / {runs[0]}" for r in runs[1:]]]
    cells = []
    for row in table["rows"]:
        vals = ["—" if v is None else f"{v:.3g}" if abs(v) < 100 else f"{v:.1f}" for v in row["values"]]
        marks = []
        for ratio, out in zip(row["ratios"][1:], row["outside_spread"][1:]):
            text = "—" if ratio is None else f"{ratio:.3f}x"
            marks.append(text + ("" if out is None else " (outside spread)" if out else " (within spread)"))
        cells.append([row["metric"], *vals, *marks])
    return header, cells
