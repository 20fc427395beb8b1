"""`dflash cache ls | verify | clean`: inspect and maintain the artifact cache."""

from __future__ import annotations

from typing import Annotated

import typer

from dflash_cli.cache.store import Cache, parse_age
from dflash_cli.cache.upkeep import clean, verify
from dflash_cli.cli.common import (
    CacheDirOpt,
    JsonOpt,
    err_console,
    examples,
    handle_errors,
    human_age,
    human_size,
    make_table,
    print_json,
    print_table,
    short_key,
)
from dflash_cli.errors import CacheError, DFlashError

cache_app = typer.Typer(help="Inspect and clean the artifact cache.", no_args_is_help=True)


def register(app: typer.Typer) -> None:
    app.add_typer(cache_app, name="cache")


@cache_app.command("ls", epilog=examples("dflash cache ls", "dflash cache ls --cache-dir /data/dflash --json"))
@handle_errors
def ls_command(cache_dir: CacheDirOpt = None, json_: JsonOpt = False) -> None:
    """List cached artifacts: recipe, stage, key, size, age (newest first)."""
    cache = Cache(cache_dir)
    entries = cache.entries()
    if json_:
        print_json(
            {
                "root": str(cache.root),
                "artifacts": [
                    {
                        "recipe": e.recipe,
                        "stage": e.stage,
                        "key": e.key,
                        "size": e.size,
                        "age_s": round(e.age_s, 1),
                        "path": str(e.path),
                        "problem": e.problem,
                    }
                    for e in entries
                ],
            }
        )
        return
    table = make_table("recipe", "stage", "key", "size", "age", "state", title=f"cache {cache.root}")
    for e in entries:
        table.add_row(e.recipe, e.stage, short_key(e.key), human_size(e.size), human_age(e.age_s), e.problem or "ok")
    print_table(table)


@cache_app.command("verify", epilog=examples("dflash cache verify", "dflash cache verify --json"))
@handle_errors
def verify_command(cache_dir: CacheDirOpt = None, json_: JsonOpt = False) -> None:
    """Re-hash every cached file; exit non-zero if any artifact is missing files or was modified."""
    cache = Cache(cache_dir)
    reports = verify(cache)
    bad = [r for r in reports if not r.ok]
    if json_:
        print_json(
            {
                "root": str(cache.root),
                "checked": len(reports),
                "corrupt": [
                    {"recipe": r.entry.recipe, "stage": r.entry.stage, "key": r.entry.key, "problems": r.problems}
                    for r in bad
                ],
            }
        )
    else:
        table = make_table("recipe", "stage", "key", "result")
        for r in reports:
            table.add_row(r.entry.recipe, r.entry.stage, short_key(r.entry.key), "; ".join(r.problems) or "ok")
        print_table(table)
    if bad:
        raise CacheError(
            f"{len(bad)} of {len(reports)} cached artifacts failed verification",
            hint="rebuild with `dflash build --force`, or remove them with `dflash cache clean`",
        )


def _confirm_everything(cache: Cache) -> None:
    """Removing every artifact (possibly hours of builds) asks first; without a terminal it needs --yes."""
    import sys

    count = sum(1 for _ in cache.entries())
    if count == 0:
        return
    if not sys.stdin.isatty():
        raise DFlashError(
            f"refusing to remove all {count} cached artifact(s) in {cache.root} without confirmation",
            hint="pass --yes to remove everything, or --older-than AGE / --dry-run",
        )
    if not typer.confirm(f"remove all {count} cached artifact(s) in {cache.root}?", default=False, err=True):
        raise typer.Exit(1)


@cache_app.command(
    "clean",
    epilog=examples("dflash cache clean --older-than 7d", "dflash cache clean --dry-run", "dflash cache clean --yes"),
)
@handle_errors
def clean_command(
    older_than: Annotated[
        str | None, typer.Option("--older-than", metavar="AGE", help="Only artifacts older than AGE (30m, 12h, 7d).")
    ] = None,
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Show what would be removed; remove nothing.")] = False,
    yes: Annotated[bool, typer.Option("--yes", "-y", help="Remove everything without asking.")] = False,
    cache_dir: CacheDirOpt = None,
    json_: JsonOpt = False,
) -> None:
    """Remove cached artifacts (all, or older than --older-than) and leftovers of interrupted builds.

    Files another artifact still uses (hard-linked weights) stay until nothing uses them. Artifacts a running
    build, run, serve or bench is reading are skipped (and named); clean again once it has finished."""
    cache = Cache(cache_dir)
    if older_than is None and not dry_run and not yes:
        _confirm_everything(cache)
    report = clean(cache, parse_age(older_than) if older_than else None, dry_run=dry_run)
    if json_:
        print_json(
            {
                "root": str(cache.root),
                "dry_run": dry_run,
                "removed": [{"recipe": e.recipe, "stage": e.stage, "key": e.key} for e in report.removed],
                "bytes_freed": report.bytes_freed,
                "tmp_removed": report.tmp_removed,
                "in_use": [
                    {"recipe": u.entry.recipe, "stage": u.entry.stage, "key": u.entry.key, "pids": list(u.pids)}
                    for u in report.in_use
                ],
            }
        )
        return
    verb = "would remove" if dry_run else "removed"
    console = err_console()
    console.print(
        f"{verb} {len(report.removed)} artifact(s), {human_size(report.bytes_freed)}"
        + (f", {report.tmp_removed} stale temp dir(s)" if report.tmp_removed else ""),
        markup=False,
        highlight=False,
    )
    if report.in_use:
        pids = sorted({pid for u in report.in_use for pid in u.pids})
        which = ", ".join(f"{u.entry.recipe} {u.entry.stage} {short_key(u.entry.key)}" for u in report.in_use)
        console.print(
            f"skipped {len(report.in_use)} artifact(s) in use by a running build or run"
            + (f" (pid {', '.join(map(str, pids))})" if pids else "")
            + f": {which}",
            markup=False,
            highlight=False,
        )
