"""Shared CLI pieces: option definitions, the one place DFlashError becomes `error:`/`hint:`, output helpers."""

from __future__ import annotations

import contextlib
import functools
import io
import json
import os
import sys
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Annotated, Any, TypeVar

import typer
from rich import box
from rich.console import Console
from rich.table import Table

from dflash_cli.errors import DFlashError

# ---------------------------------------------------------------------------------------------
# Options shared by several commands (kebab-case flags, one definition each).

RecipeOpt = Annotated[
    str,
    typer.Option("--recipe", "-r", help="Recipe name (see `dflash recipes list`) or path to a .yaml file."),
]
RecipeArg = Annotated[
    str | None, typer.Argument(metavar="[RECIPE]", help="Recipe name or .yaml path (same as --recipe).")
]
SetOpt = Annotated[
    list[str] | None,
    typer.Option(
        "--set",
        metavar="KEY=VALUE",
        help="Override a recipe field, e.g. --set export.ctx_len=2048 (repeatable; value parsed as YAML).",
    ),
]
CacheDirOpt = Annotated[
    Path | None,
    typer.Option("--cache-dir", help="Artifact cache root (default: $DFLASH_HOME, else ~/.cache/dflash)."),
]
ForceOpt = Annotated[bool, typer.Option("--force", help="Rebuild even when the artifact is cached.")]
RebuildOpt = Annotated[
    list[str] | None,
    typer.Option("--rebuild", metavar="STAGE", help="Rebuild this stage and every stage after it (repeatable)."),
]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print exactly one JSON document on stdout, nothing else.")]


def pick_recipe(ctx: typer.Context, recipe_arg: str | None, recipe: str) -> str:
    """The recipe of a command taking both forms: the positional RECIPE, else --recipe.

    Both given and naming different recipes is a usage error (exit 2) rather than one silently winning;
    the same recipe twice (`demo -r demo`, or a name and its file) is fine.
    """
    if recipe_arg is None:
        return recipe
    given = ctx.get_parameter_source("recipe").name not in ("DEFAULT", "DEFAULT_MAP")
    if recipe_arg != recipe and given and not _same_recipe_file(recipe_arg, recipe):
        raise typer.BadParameter(
            f"two different recipes given: {recipe_arg!r} (argument) and {recipe!r} (--recipe); pass one",
            param_hint="RECIPE / --recipe",
        )
    return recipe_arg


def _same_recipe_file(a: str, b: str) -> bool:
    from dflash_cli.errors import RecipeError
    from dflash_cli.recipe.files import find_recipe

    try:
        return find_recipe(a).resolve() == find_recipe(b).resolve()
    except (RecipeError, OSError):
        return False


def examples(*commands: str) -> str:
    """Epilog text for a command's help: one example per paragraph (rich help keeps paragraphs)."""
    return "Examples:\n\n" + "\n\n".join(f"  {c}" for c in commands)


# ---------------------------------------------------------------------------------------------
# Errors

F = TypeVar("F", bound=Callable[..., Any])


def debug_enabled() -> bool:
    return os.environ.get("DFLASH_DEBUG", "") not in ("", "0", "false", "no")


def report_error(err: DFlashError) -> None:
    """`error: <message>` and, when there is one, `hint: <hint>` on stderr."""
    console = err_console()
    console.print(f"error: {err.message}", markup=False, highlight=False, soft_wrap=True)
    if err.hint:
        console.print(f"hint: {err.hint}", markup=False, highlight=False, soft_wrap=True)


def handle_errors(fn: F) -> F:
    """Turn DFlashError into one or two lines and its exit code; DFLASH_DEBUG=1 shows the traceback."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except DFlashError as err:
            if debug_enabled():
                raise
            report_error(err)
            raise typer.Exit(err.exit_code) from None
        except KeyboardInterrupt:
            if debug_enabled():
                raise
            err_console().print("interrupted", markup=False)
            raise typer.Exit(130) from None

    return wrapper  # type: ignore[return-value]


# ---------------------------------------------------------------------------------------------
# Output: tables and progress go to stderr unless they are the command's result; --json is plain.


def err_console() -> Console:
    # Built per call so it binds to the current sys.stderr (test runners swap it).
    return Console(file=sys.stderr, width=None if sys.stderr.isatty() else 200)


def out_console() -> Console:
    return Console(file=sys.stdout, width=None if sys.stdout.isatty() else 200)


def print_json(doc: Any) -> None:
    """The whole stdout of a `--json` command: one document, no colour, no rich."""
    sys.stdout.write(json.dumps(doc, indent=2, default=str) + "\n")
    sys.stdout.flush()


@contextlib.contextmanager
def stdout_to_stderr() -> Iterator[None]:
    """Send everything written to stdout (Python prints and C-level fd 1 writes) to stderr.

    Wrapped around the work of a `--json` command so a chatty library (exporters, runtimes) can
    never corrupt the one JSON document that stdout must carry.
    """
    sys.stdout.flush()
    try:
        out_fd, err_fd = sys.stdout.fileno(), sys.stderr.fileno()
        saved = os.dup(out_fd)
    except (AttributeError, OSError, io.UnsupportedOperation):
        saved = None  # not real files (a test runner): Python-level redirection still applies
    try:
        if saved is not None:
            os.dup2(err_fd, out_fd)
        with contextlib.redirect_stdout(sys.stderr):
            yield
    finally:
        sys.stderr.flush()
        if saved is not None:
            os.dup2(saved, out_fd)
            os.close(saved)


def make_table(*columns: str, title: str | None = None, plain: bool = False) -> Table:
    table = Table(title=title, box=None if plain else box.SIMPLE_HEAD, title_justify="left", pad_edge=False)
    for col in columns:
        table.add_column(col, overflow="fold")
    return table


def show_settings(title: str, rows: Iterable[tuple[str, Any]]) -> None:
    """The effective settings, on stderr, before any work starts."""
    table = make_table("setting", "value", title=title)
    for key, value in rows:
        table.add_row(key, "-" if value is None else str(value))
    _print(err_console(), table)


def print_table(table: Table) -> None:
    """A command's result table on stdout (plain columns when stdout is not a terminal)."""
    _print(out_console(), table)


def _print(console: Console, table: Table) -> None:
    if console.is_terminal:
        console.print(table)
        return
    # Plain text for pipes and logs: no box, no padding at line ends (easy to grep and diff).
    table.box = None
    with console.capture() as captured:
        console.print(table)
    console.file.write("\n".join(line.rstrip() for line in captured.get().splitlines()) + "\n")


def human_size(n: int | float) -> str:
    """Binary units, labelled as such (1 MiB = 1024 KiB)."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def human_age(seconds: float) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds / size:.1f}{unit}"
    return f"{seconds:.0f}s"


def short_key(key: str) -> str:
    return key[:12]
