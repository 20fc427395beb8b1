"""`dflash bench compare A.json B.json`: two or more `--output` documents side by side (ratios, and whether
each lies outside the other's spread); any `bench` option it does not read is a usage error."""

from __future__ import annotations

import sys
from pathlib import Path

import typer

from dflash_cli.cli.common import out_console, print_json


def refuse_options_compare_ignores(ctx: typer.Context) -> None:
    """`compare` only reads its documents: any other option given with it was ignored without a word
    (`--endpoint URL` exited 0), so it is a usage error (exit 2) instead."""
    given = [
        "/".join([param.opts[0], *param.secondary_opts[:1]])  # --plain-best/--plain-same
        for param in ctx.command.params
        if param.name not in ("compare_args", "json_", "format_")
        and ctx.get_parameter_source(param.name).name == "COMMANDLINE"  # not an environment variable's
    ]
    if given:
        raise typer.BadParameter(
            f"`bench compare` only reads its documents: {', '.join(given)} "
            f"{'does' if len(given) == 1 else 'do'} not apply to it (it takes --json / --format)",
            param_hint=" / ".join(given),
        )


def compare_documents(paths: list[Path], fmt: str) -> None:
    from dflash_cli.bench.compare import compare, load_documents, render_rows

    docs = load_documents(paths)
    table = compare(docs, [p.name for p in paths])
    if fmt == "json":
        print_json(table)
        return
    header, cells = render_rows(table)
    if fmt in ("md", "csv"):
        sep = " | " if fmt == "md" else ","
        lines = [sep.join(header), *(sep.join(c) for c in cells)]
        if fmt == "md":
            lines = [f"| {lines[0]} |", "|" + " --- |" * len(header), *(f"| {line} |" for line in lines[1:])]
        sys.stdout.write("\n".join(lines) + "\n")
        return
    from rich.table import Table

    t = Table(title="dflash bench compare", title_justify="left")
    for i, h in enumerate(header):
        t.add_column(h, justify="left" if i == 0 else "right")
    for c in cells:
        t.add_row(*c)
    out_console().print(t)
