"""Single-stage commands (`dflash convert`, `dflash inject`): build one stage and whatever it needs."""

from __future__ import annotations

from collections.abc import Callable

import typer

from dflash_cli.cli.build import execute_build
from dflash_cli.cli.common import CacheDirOpt, ForceOpt, JsonOpt, RebuildOpt, RecipeOpt, SetOpt, examples, handle_errors
from dflash_cli.recipe.schema import DEFAULT_RECIPE

# (stage name, one-line help). Stages with more options of their own get a module of their own.
STAGE_COMMANDS: tuple[tuple[str, str], ...] = (
    ("convert", "Locate and validate the target/draft pair and write normalised checkpoints."),
    ("inject", "Share weights across the pair: target embed/lm_head into the draft, fc/hidden_norm into the target."),
    ("export", "Export target.onnx and draft.onnx (static KV cache, only seq_len symbolic) and validate every output."),
)


def register(app: typer.Typer) -> None:
    for name, summary in STAGE_COMMANDS:
        app.command(
            name,
            help=f"{summary} Builds missing upstream stages first; --force rebuilds only this stage.",
            epilog=examples(f"dflash {name} --recipe demo", f"dflash {name} -r qwen3-8b --force --json"),
        )(_stage_command(name))


def _stage_command(stage: str) -> Callable[..., None]:
    @handle_errors
    def command(
        recipe: RecipeOpt = DEFAULT_RECIPE,
        set_: SetOpt = None,
        cache_dir: CacheDirOpt = None,
        force: ForceOpt = False,
        rebuild: RebuildOpt = None,
        json_: JsonOpt = False,
    ) -> None:
        # --force on a single-stage command means "this stage", not the whole chain before it.
        stages = set(rebuild or []) | ({stage} if force else set())
        execute_build(recipe, set_ or [], cache_dir, force=False, rebuild=stages, upto=stage, as_json=json_)

    command.__name__ = f"{stage}_command"
    return command
