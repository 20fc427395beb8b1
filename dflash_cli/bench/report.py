"""The bench for a person: rich tables rendered from the JSON document, and a live progress bar.

Tables read the same document CI reads (dflash_cli.bench.document), so the two never disagree.
Nothing here prints by itself: tables are returned, and the progress bar draws on the console
the caller hands it (the CLI gives it stderr, keeping stdout clean for --json).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from rich.console import Console, RenderableType
from rich.markup import escape
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    SpinnerColumn,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.table import Table
from rich.text import Text

from dflash_cli.bench.document import MODE_SECTIONS, build_document, build_sweep_document
from dflash_cli.bench.runner import BenchProgress
from dflash_cli.decoding.modes import SPECULATIVE_MODES

__all__ = [
    "LiveProgress",
    "build_document",
    "build_sweep_document",
    "report_renderables",
]

_MODE_LABELS = dict(MODE_SECTIONS)
_BAR_WIDTH = 24


def _num(value: float | None, fmt: str, scale: float = 1.0, suffix: str = "") -> str:
    return "—" if value is None else f"{value * scale:{fmt}}{suffix}"


def report_renderables(doc: dict[str, Any]) -> list[RenderableType]:
    """Summary, acceptance histogram, per-position acceptance, decomposition, sweep and lossless status."""
    parts: list[RenderableType] = [summary_table(doc)]
    spec_decode = (doc.get("endpoint") or {}).get("spec_decode")
    if spec_decode:  # a server's acceptance is "unavailable: <why>" where its counters are missing or unusable
        parts.append(Text(f"endpoint acceptance (tau): {spec_decode}"))
    spec_modes = [m for m in SPECULATIVE_MODES if doc.get(m)]
    if spec_modes:
        parts.append(histogram_table(doc, spec_modes))
        parts.append(position_table(doc, spec_modes))
    if (doc.get("hybrid") or {}).get("sources"):
        parts.append(sources_line(doc["hybrid"]["sources"]))
    if doc.get("decomposition"):
        parts.append(decomposition_table(doc["decomposition"]))
    if doc.get("sweep"):
        parts.append(sweep_table(doc["sweep"]))
    plain_on = (doc.get("environment") or {}).get("plain_session")
    if plain_on and doc.get("baseline"):
        parts.append(Text(f"plain ran on {plain_on}"))
    parts.append(lossless_line(doc["lossless"]))
    return parts


def sources_line(sources: dict[str, dict[str, float]]) -> Text:
    """Hybrid: which proposer took how many steps, and how far each one's proposals were accepted."""
    parts = [
        f"{name} {s['share'] * 100:.0f}% of steps (tau {s['mean_acceptance_length']:.2f}"
        + (f", {s['mean_verify_tokens']:.1f} tokens verified)" if "mean_verify_tokens" in s else ")")
        for name, s in sources.items()
    ]
    return Text("hybrid proposers: " + ", ".join(parts))


def summary_table(doc: dict[str, Any]) -> Table:
    dataset = doc["dataset"]
    settings = doc["settings"]
    if settings.get("endpoint"):  # a server's run has no recipe or block size of its own
        what, block = f"{settings.get('model')} at {settings['endpoint']}", ""
    else:
        what, block = str(settings.get("recipe")), f"block {settings.get('block_size')}, "
    table = Table(
        title=f"dflash bench — {escape(what)} on {escape(dataset['name'])} "
        f"({dataset['n_samples']} samples, {block}temperature {settings.get('temperature')})",
        title_justify="left",
    )
    # tau pools every verify step; "tau/sample" averages per prompt first (z-lab's convention).
    columns = ("mode", "decode tok/s", "TPOT ms (median ± sd)", "TTFT ms", "tau", "tau/sample", "speedup [95% CI]")
    for column in (*columns, "repetition"):
        table.add_column(column, justify="left" if column == "mode" else "right")
    for key, label in _MODE_LABELS.items():
        summary = doc.get(key)
        if not summary:
            continue
        speedup = summary.get("decode_speedup") if key != "baseline" else 1.0
        ci = (summary.get("decode_speedup_bootstrap") or {}).get("ci95")
        tpot = summary.get("tpot_ms_spread") or {}
        tpot_text = (
            f"{tpot['median']:.2f} ± {tpot['std']:.2f}"
            if tpot.get("median") is not None
            else _num(summary.get("tpot_s"), ".2f", 1e3)
        )
        ttft = summary.get("ttft_s")
        ttft = ttft if ttft is not None else (summary.get("median_ttft_ms") or 0) / 1e3 or None
        table.add_row(
            label,
            _num(summary.get("decode_tokens_per_s"), ".1f"),
            tpot_text,
            _num(ttft, ".1f", 1e3),
            _num(summary.get("mean_acceptance_length"), ".2f"),
            _num(summary.get("mean_acceptance_length_per_sample"), ".2f"),
            _num(speedup, ".2f", suffix="x") + (f" [{ci[0]:.2f}, {ci[1]:.2f}]" if ci else ""),
            _num(summary.get("repetition_rate"), ".1%"),
        )
    return table


def histogram_table(doc: dict[str, Any], modes: Iterable[str]) -> Table:
    table = Table(title="tokens committed per verify step", title_justify="left")
    table.add_column("accepted", justify="right")
    modes = list(modes)
    histograms = {m: doc[m]["acceptance_histogram"] for m in modes}
    for mode in modes:
        table.add_column(_MODE_LABELS[mode], justify="right")
        table.add_column("", justify="left")
    lengths = max((histograms[m]["lengths"] for m in modes), key=len)  # the hybrid's may run past the block
    for i, length in enumerate(lengths):
        row = [str(length)]
        for mode in modes:
            if i >= len(histograms[mode]["counts"]):
                row += ["", ""]
                continue
            fraction = histograms[mode]["fractions"][i]
            row += [f"{histograms[mode]['counts'][i]} ({fraction:.0%})", "█" * round(fraction * _BAR_WIDTH)]
        table.add_row(*row)
    return table


def position_table(doc: dict[str, Any], modes: Iterable[str]) -> Table:
    table = Table(title="P(draft token k accepted | step reached k)", title_justify="left")
    table.add_column("k", justify="right")
    modes = list(modes)
    for mode in modes:
        table.add_column(_MODE_LABELS[mode], justify="right")
    rates = {m: doc[m]["per_position_acceptance"] for m in modes}
    for i in range(max(len(r) for r in rates.values())):
        table.add_row(str(i + 1), *(_num(rates[m][i] if i < len(rates[m]) else None, ".1%") for m in modes))
    return table


def decomposition_table(dec: dict[str, Any]) -> Table:
    table = Table(title="where the speedup goes (dflash)", title_justify="left", show_header=False)
    table.add_column("quantity")
    table.add_column("value", justify="right")
    table.add_row("plain step T(1)", _num(dec["t1_s"], ".2f", 1e3, " ms"))
    table.add_row(f"verify step T({dec['block_size']})", _num(dec["t_verify_s"], ".2f", 1e3, " ms"))
    table.add_row("draft step", _num(dec["t_draft_s"], ".2f", 1e3, " ms"))
    if dec.get("verify_cost_ratio"):
        ratios = "  ".join(
            f"{n}: {r:.2f}" for n, r in sorted(dec["verify_cost_ratio"].items(), key=lambda i: int(i[0]))
        )
        table.add_row("verify cost T(n)/T(1)", ratios)
    if dec.get("break_even_tau") is not None:
        table.add_row("break-even tau (T_verify+T_draft)/T(1)", _num(dec["break_even_tau"], ".2f"))
    if dec.get("break_even_tau_by_rows"):
        rows = sorted(dec["break_even_tau_by_rows"].items(), key=lambda i: int(i[0]))
        table.add_row("break-even tau, n rows drafted+verified", "  ".join(f"{n}: {t:.2f}" for n, t in rows))
    if dec.get("break_even_tau_by_verify"):
        rows = sorted(dec["break_even_tau_by_verify"].items(), key=lambda i: int(i[0]))
        table.add_row("break-even tau, n verified, n-1 proposed", "  ".join(f"{n}: {t:.2f}" for n, t in rows))
    if dec.get("verify_row_s") is not None:
        table.add_row("verify row (T(B)-T(1))/(B-1)", _verify_row(dec))
    table.add_row("tau", _num(dec["mean_acceptance_length"], ".2f"))
    table.add_row("ceiling tau·T(1)/(T_verify+T_draft)", _num(dec["ceiling_speedup"], ".2f", suffix="x"))
    table.add_row("measured speedup", _num(dec["measured_speedup"], ".2f", suffix="x"))
    for mode, gbs in dec["weight_bandwidth_gb_s"].items():
        table.add_row(f"weight bandwidth ({mode})", _num(gbs, ".1f", suffix=" GB/s"))
    table.add_row("loop overhead (outside sessions)", _num(dec["loop_overhead_fraction"], ".1%"))
    return table


def _verify_row(dec: dict[str, Any]) -> str:
    text = _num(dec["verify_row_s"], ".1f", 1e3, " ms")
    if dec.get("verify_row_gops"):
        text += f", {dec['verify_row_gops']:.0f} GOP/s"
        peak = dec.get("machine_peak")
        if peak:
            text += f" (peak {peak['int8_gops']:.0f} int8 / {peak['fp32_gflops']:.0f} fp32, {peak['isa']})"
    return text


def sweep_table(sweep: dict[str, Any]) -> Table:
    table = Table(title="block size sweep", title_justify="left")
    for column in ("block", "dflash tok/s", "speedup", "tau", "ceiling", "mismatches"):
        table.add_column(column, justify="right")
    for row in sweep["runs"]:
        best = row["block_size"] == sweep["fastest_block_size"]
        table.add_row(
            f"{row['block_size']}{' ★' if best else ''}",
            _num(row["decode_tokens_per_s"], ".1f"),
            _num(row["decode_speedup"], ".2f", suffix="x"),
            _num(row["mean_acceptance_length"], ".2f"),
            _num(row["ceiling_speedup"], ".2f", suffix="x"),
            str(row["lossless_mismatches"]),
            style="bold" if best else None,
        )
    table.caption = f"fastest: block size {sweep['fastest_block_size']}"
    return table


def lossless_line(lossless: dict[str, Any]) -> str:
    if not lossless["checked"]:
        return "[dim]lossless: not checked (needs temperature 0 and the plain baseline)[/dim]"
    mismatches = lossless["mismatches"]
    if not mismatches:
        return "[green]lossless: every speculative output matched plain greedy decoding[/green]"
    first = mismatches[0]
    return (
        f"[red]lossless: {len(mismatches)} mismatch(es); first: {first['mode']} on sample "
        f"{escape(repr(first['sample_id']))} turn {first['turn']} at {first.get('unit', 'token')} "
        f"{first['position']}[/red]"
    )


class LiveProgress:
    """Progress with the running tau on `console` (stderr in the CLI) while a bench runs.

    `live=True` draws a rich bar (a terminal); otherwise each finished turn is one plain line,
    so CI logs show progress without control codes.
    """

    def __init__(self, console: Console, description: str = "bench", *, live: bool = True) -> None:
        self._console = console
        self._description = description
        self._live = live
        self._progress = Progress(
            SpinnerColumn(),
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("tau {task.fields[tau]}"),
            TextColumn("[dim]{task.fields[sample]}"),
            TimeElapsedColumn(),
            TimeRemainingColumn(),
            console=console,
            disable=not live,
        )
        self._task = self._progress.add_task(escape(description), total=None, tau="—", sample="")

    def __enter__(self) -> LiveProgress:
        self._progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._progress.stop()

    def update(self, event: BenchProgress) -> None:
        """on_progress callback for run_bench."""
        sample = f"{event.sample_id}#{event.turn}" + (" (resumed)" if event.resumed else "")
        tau = _num(event.tau, ".2f")
        if not self._live:
            line = f"{self._description} [{event.done}/{event.total}] {sample} tau {tau}"
            self._console.print(line, markup=False, highlight=False)
            return
        self._progress.update(self._task, total=event.total, completed=event.done, tau=tau, sample=escape(sample))
