"""`dflash compile`: compile the exported graphs for a backend, or emit a QAIC bundle for another host."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from dflash_cli.cli.build import execute_build
from dflash_cli.cli.common import (
    CacheDirOpt,
    ForceOpt,
    JsonOpt,
    RebuildOpt,
    RecipeOpt,
    SetOpt,
    err_console,
    examples,
    handle_errors,
    print_json,
)
from dflash_cli.recipe.schema import DEFAULT_RECIPE


def register(app: typer.Typer) -> None:
    app.command(
        "compile",
        epilog=examples(
            "dflash compile --recipe demo",
            "dflash compile -r demo --set compile.ort.precision=int4",
            "dflash compile -r qwen3-8b --backend qaic",
            "dflash compile -r qwen3-8b --backend qaic --emit-script ./qaic-bundle   # no card or SDK needed",
        ),
    )(compile_command)


@handle_errors
def compile_command(
    recipe: RecipeOpt = DEFAULT_RECIPE,
    set_: SetOpt = None,
    cache_dir: CacheDirOpt = None,
    backend: Annotated[str | None, typer.Option("--backend", help="ort or qaic (default: compile.backend).")] = None,
    emit_script: Annotated[
        Path | None,
        typer.Option(
            "--emit-script",
            metavar="DIR",
            help="QAIC only: write the ONNX files, specializations/custom-IO files and compile.sh into DIR "
            "instead of compiling.",
        ),
    ] = None,
    force: ForceOpt = False,
    rebuild: RebuildOpt = None,
    json_: JsonOpt = False,
) -> None:
    """Compile the exported graphs: ONNX Runtime (default; fp32, or weight-only int8 / int4) or Cloud AI 100."""
    overrides = list(set_ or []) + ([f"compile.backend={backend}"] if backend else [])
    if emit_script is None:
        stages = set(rebuild or []) | ({"compile"} if force else set())
        execute_build(recipe, overrides, cache_dir, force=False, rebuild=stages, upto="compile", as_json=json_)
        return
    from dflash_cli.cache.store import Cache
    from dflash_cli.families import require_qaic_support
    from dflash_cli.qaic.bundle import emit_bundle
    from dflash_cli.qaic.command import QaicCompileOptions
    from dflash_cli.recipe.schema import load_recipe
    from dflash_cli.stages.pipeline import build

    r = load_recipe(recipe, overrides)
    require_qaic_support(r.family)
    result = build(r, Cache(cache_dir), upto="export", hold=True)  # `cache clean` spares it while we copy
    options = QaicCompileOptions.from_mapping(r.compile.qaic.model_dump())
    bundle = emit_bundle(result.path("export"), emit_script, options, r.compile.qaic.aic_hw_version)
    if json_:
        print_json({"recipe": r.name, "bundle": str(bundle)})
    else:
        err_console().print(
            f"QAIC bundle written to {bundle}; on a host with the SDK run: bash {bundle}/compile.sh",
            markup=False,
            highlight=False,
        )
