"""`dflash build`: run every stage that is not cached. Also the shared runner for single-stage commands."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Annotated, Any

import typer

from dflash_cli.cli.common import (
    CacheDirOpt,
    ForceOpt,
    JsonOpt,
    RebuildOpt,
    RecipeArg,
    RecipeOpt,
    SetOpt,
    err_console,
    examples,
    handle_errors,
    human_size,
    make_table,
    pick_recipe,
    print_json,
    print_table,
    short_key,
    show_settings,
    stdout_to_stderr,
)
from dflash_cli.recipe.schema import DEFAULT_RECIPE

NOTE_PREFIXES = ("note:", "warning:")  # progress lines a terminal keeps (the rest only update the spinner)
UptoOpt = Annotated[str | None, typer.Option("--upto", metavar="STAGE", help="Stop after this stage.")]


def register(app: typer.Typer) -> None:
    app.command(
        "build",
        epilog=examples("dflash build --recipe demo", "dflash build -r qwen3-8b --set export.ctx_len=2048"),
    )(build_command)


@handle_errors
def build_command(
    ctx: typer.Context,
    recipe_arg: RecipeArg = None,
    recipe: RecipeOpt = DEFAULT_RECIPE,
    set_: SetOpt = None,
    cache_dir: CacheDirOpt = None,
    force: ForceOpt = False,
    rebuild: RebuildOpt = None,
    upto: UptoOpt = None,
    json_: JsonOpt = False,
) -> None:
    """Build every stage of a recipe (convert -> inject -> export -> compile), reusing cached artifacts."""
    recipe = pick_recipe(ctx, recipe_arg, recipe)
    check_stage_names(upto, rebuild)
    execute_build(recipe, set_ or [], cache_dir, force=force, rebuild=set(rebuild or []), upto=upto, as_json=json_)


def check_stage_names(upto: str | None, rebuild: list[str] | None) -> None:
    """A misspelt stage is a usage error (exit 2, with the choices), before anything is printed or built."""
    from dflash_cli.recipe.schema import did_you_mean
    from dflash_cli.stages.pipeline import STAGE_NAMES

    for flag, names in (("--upto", [upto] if upto else []), ("--rebuild", rebuild or [])):
        for name in names:
            if name not in STAGE_NAMES:
                raise typer.BadParameter(
                    f"unknown stage {name!r}{did_you_mean(name, STAGE_NAMES)} (stages: {', '.join(STAGE_NAMES)})",
                    param_hint=flag,
                )


def execute_build(
    recipe_ref: str,
    overrides: list[str],
    cache_dir: Path | None,
    *,
    force: bool,
    rebuild: set[str],
    upto: str | None,
    as_json: bool,
) -> None:
    """Load the recipe, show the settings, build with progress, print the result (table or JSON)."""
    # Imported here so `dflash --help` never loads the stage graph.
    from dflash_cli.cache.store import Cache
    from dflash_cli.recipe.schema import load_recipe
    from dflash_cli.stages.pipeline import build

    recipe = load_recipe(recipe_ref, overrides)
    cache = Cache(cache_dir)
    if recipe.compile.backend == "qaic" and upto in (None, "compile"):
        from dflash_cli.families import require_qaic_support

        require_qaic_support(recipe.family)
        _require_qaic_sdk()  # before minutes of convert/inject/export that could not be compiled here
    show_settings(
        f"dflash build: {recipe.name}",
        [
            ("recipe", recipe.source or recipe.name),
            ("family", recipe.family),
            ("target", recipe.target.path),
            ("draft", recipe.draft.path),
            ("block_size", recipe.dflash.block_size or "from draft config"),
            ("ctx_len / prefill", f"{recipe.export.ctx_len} / {recipe.export.prefill_seq_len}"),
            ("export dtype", recipe.export.dtype),
            ("backend", recipe.compile.backend),
            *([("ort precision", recipe.compile.ort.precision)] if recipe.compile.backend == "ort" else []),
            ("upto", upto or "all stages"),
            ("cache", cache.root),
        ],
    )
    guard = stdout_to_stderr() if as_json else contextlib.nullcontext()
    with guard, build_progress() as on_event:
        result = build(recipe, cache, upto=upto, force=force, rebuild=rebuild, progress=_freezing(on_event))
    if as_json:
        print_json(result.to_dict())
        return
    table = make_table(
        "stage", "status", "seconds", "size", "new on disk", "peak RSS", "key", title=f"recipe {recipe.name}"
    )
    for stage in result.stages:
        table.add_row(
            stage.name,
            stage.status,
            f"{stage.seconds:.2f}",
            human_size(stage.size),
            human_size(stage.new_bytes),
            human_size(stage.peak_rss_bytes),
            short_key(stage.key),
        )
    print_table(table)
    if result.stages:
        last = result.stages[-1]
        err_console().print(f"{last.name} artifact: {last.path}", markup=False, highlight=False)


def _freezing(on_event: Callable[[Any], None]) -> Callable[[Any], None]:
    """`dflash build` is a one-shot process: after each stage, what it imported (torch, onnx, transformers:
    millions of objects living as long as the process) leaves the cyclic collector's view, so the next
    stage's full collections scan only what that stage creates. Here, not in the library: `serve` and
    bench sweeps build too, and must keep collecting everything."""
    import gc

    def handler(event: Any) -> None:
        on_event(event)
        if event.kind == "done":
            gc.freeze()

    return handler


def _require_qaic_sdk() -> None:
    from dflash_cli.qaic.sdk import require_sdk

    require_sdk()


@contextlib.contextmanager
def build_progress() -> Iterator[Callable[[Any], None]]:
    """A BuildEvent callback: a rich spinner on a terminal, plain `stage: message` lines otherwise."""
    console = err_console()
    if not console.is_terminal:

        def plain(event: Any) -> None:
            if event.kind in ("message", "wait", "done"):
                console.print(f"{event.stage}: {event.message}", markup=False, highlight=False)

        yield plain
        return

    from rich.markup import escape
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    with Progress(
        SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(), console=console, transient=True
    ) as progress:
        tasks: dict[str, Any] = {}

        def rich_event(event: Any) -> None:
            label = escape(f"[{event.index + 1}/{event.total}] {event.stage}")
            if event.kind == "start":
                tasks[event.stage] = progress.add_task(label, total=None)
            elif event.kind in ("message", "wait"):
                progress.update(tasks[event.stage], description=f"{label}: {escape(event.message)}")
                if event.message.startswith(NOTE_PREFIXES):  # stays on screen once the spinner is gone
                    plain_label = f"[{event.index + 1}/{event.total}] {event.stage}"
                    console.print(f"{plain_label}: {event.message}", markup=False, highlight=False)
            elif event.kind == "done":
                progress.remove_task(tasks.pop(event.stage))
                console.print(f"{label}: {event.message}", markup=False, highlight=False)

        yield rich_event
