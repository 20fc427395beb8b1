"""`dflash bench ... --plot FILE`: the pictures of a bench document, as a self-contained .html or a .png.

Drawn: per-position acceptance of each speculative mode; each mode's per-prompt decode speedup over plain
(one dot a prompt, the median marked); and for `--endpoint --concurrency`, output throughput and TTFT /
TPOT percentiles against the number of concurrent requests. The .html needs nothing (inline SVG, no
scripts); the .png needs matplotlib (`pip install 'dflash-toolchain[plot]'`).
"""

from __future__ import annotations

import html
import statistics
from pathlib import Path
from typing import Any

from dflash_cli.errors import DFlashError

Series = list[tuple[str, list[tuple[float, float]]]]  # (name, points)
COLORS = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b")
SPECULATIVE = ("dflash", "lookup", "hybrid")


def charts(doc: dict[str, Any]) -> list[tuple[str, str, str, Series, str]]:
    """(title, x label, y label, series, "line" | "dots") of every chart the document has data for."""
    out = []
    acceptance = [
        (m, list(enumerate(doc[m]["per_position_acceptance"], 1))) for m in _modes(doc, "per_position_acceptance")
    ]
    if acceptance:
        out.append(("Per-position acceptance", "draft position", "accepted fraction", acceptance, "line"))
    speedups = []
    for k, m in enumerate(_modes(doc, "decode_speedup_per_sample")):
        values = sorted(doc[m]["decode_speedup_per_sample"].values())
        spread = [(k + 1 + 0.5 * (i / max(1, len(values) - 1) - 0.5), v) for i, v in enumerate(values)]
        speedups.append((f"{m} (median {statistics.median(values):.2f}x)", spread))
    if speedups:
        out.append(("Per-prompt decode speedup over plain", "mode", "speedup (x)", speedups, "dots"))
    loads = [r for r in doc.get("load") or [] if r.get("completed")]
    if loads:
        x = [float(r["max_concurrency"]) for r in loads]
        through = [("output tokens/s", list(zip(x, [r["output_throughput"] for r in loads])))]
        out.append(("Throughput against load", "concurrent requests", "output tokens/s", through, "line"))
        lat = [
            (f"{q} {name}", list(zip(x, [r.get(f"{q}_{name}_ms", float("nan")) for r in loads])))
            for name in ("tpot", "ttft")
            for q in ("median", "p99")
        ]
        out.append(("Latency against load", "concurrent requests", "milliseconds", lat, "line"))
    return out


def _modes(doc: dict[str, Any], key: str) -> list[str]:
    return [m for m in SPECULATIVE if isinstance(doc.get(m), dict) and doc[m].get(key)]


def write_plot(doc: dict[str, Any], path: Path) -> None:
    found = charts(doc)
    if not found:
        raise DFlashError("nothing to plot in this run", hint="--plot draws speculative modes and --concurrency runs")
    if path.suffix.lower() == ".html":
        body = "\n".join(f"<h2>{html.escape(c[0])}</h2>\n{svg(*c)}" for c in found)
        path.write_text(f"<!doctype html><meta charset='utf-8'><title>dflash bench</title>\n<body>{body}</body>\n")
    elif path.suffix.lower() == ".png":
        _png(found, path)
    else:
        raise DFlashError(f"--plot {path}: unknown picture format", hint="name it .html or .png")


def svg(title: str, xlabel: str, ylabel: str, series: Series, kind: str, w: int = 640, h: int = 360) -> str:
    pts = [p for _, s in series for p in s if p[1] == p[1]]  # NaN-free
    if not pts:
        return "<p>no values to draw</p>"
    x0, x1 = min(p[0] for p in pts), max(p[0] for p in pts)
    y0, y1 = min(0.0, min(p[1] for p in pts)), max(p[1] for p in pts) or 1.0
    x1, y1 = (x1 if x1 > x0 else x0 + 1), y1 * 1.05
    left, right, top, bottom = 70, w - 170, 20, h - 50

    def at(x: float, y: float) -> tuple[float, float]:
        return left + (x - x0) / (x1 - x0) * (right - left), bottom - (y - y0) / (y1 - y0) * (bottom - top)

    parts = [
        f"<svg xmlns='http://www.w3.org/2000/svg' width='{w}' height='{h}' font-family='sans-serif' font-size='12'>"
    ]
    parts.append(f"<title>{html.escape(title)}</title>")
    parts.append(f"<path d='M{left},{top}V{bottom}H{right}' fill='none' stroke='#333'/>")
    for i in range(6):
        y = y0 + (y1 - y0) * i / 5
        _, py = at(x0, y)
        parts.append(f"<text x='{left - 6}' y='{py + 4:.1f}' text-anchor='end'>{y:.3g}</text>")
        parts.append(f"<path d='M{left},{py:.1f}H{right}' stroke='#eee'/>")
    ticks = sorted({p[0] for p in pts}) if kind == "line" and len({p[0] for p in pts}) <= 16 else []
    for x in ticks:
        px, _ = at(x, y0)
        parts.append(f"<text x='{px:.1f}' y='{bottom + 16}' text-anchor='middle'>{x:g}</text>")
    parts.append(f"<text x='{(left + right) / 2}' y='{h - 12}' text-anchor='middle'>{html.escape(xlabel)}</text>")
    middle = (top + bottom) / 2
    parts.append(
        f"<text transform='translate(16,{middle}) rotate(-90)' text-anchor='middle'>{html.escape(ylabel)}</text>"
    )
    for k, (name, points) in enumerate(series):
        color = COLORS[k % len(COLORS)]
        xy = [at(x, y) for x, y in points if y == y]
        if kind == "line":
            d = "M" + "L".join(f"{x:.1f},{y:.1f}" for x, y in xy)
            parts.append(f"<path d='{d}' fill='none' stroke='{color}' stroke-width='2'/>")
        parts += [f"<circle cx='{x:.1f}' cy='{y:.1f}' r='3' fill='{color}'/>" for x, y in xy]
        parts.append(f"<rect x='{right + 12}' y='{top + 18 * k}' width='10' height='10' fill='{color}'/>")
        parts.append(f"<text x='{right + 26}' y='{top + 18 * k + 9}'>{html.escape(name)}</text>")
    parts.append("</svg>")
    return "\n".join(parts)


def _png(found, path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise DFlashError(
            "--plot .png needs matplotlib", hint="pip install 'dflash-toolchain[plot]', or name the file .html"
        ) from None
    fig, axes = plt.subplots(len(found), 1, figsize=(8, 3.6 * len(found)), squeeze=False)
    for ax, (title, xlabel, ylabel, series, kind) in zip(axes[:, 0], found):
        for name, points in series:
            xs, ys = [p[0] for p in points], [p[1] for p in points]
            ax.plot(xs, ys, "o-" if kind == "line" else "o", label=name, markersize=3)
        ax.set(title=title, xlabel=xlabel, ylabel=ylabel)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
