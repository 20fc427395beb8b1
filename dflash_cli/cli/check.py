"""`dflash check`: accelerator readiness of the exported graphs (static shapes, ops, fp16 emulation)."""

from __future__ import annotations

import functools
from typing import Annotated

import typer

from dflash_cli.cli.common import (
    CacheDirOpt,
    JsonOpt,
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
        "check",
        epilog=examples(
            "dflash check --recipe demo",
            "dflash check -r demo --fp16-prompts 164 --json   # fp16 emulation on every HumanEval prompt",
            "dflash check -r qwen3-8b --fp16-prompts 0         # shapes and ops only",
        ),
    )(check_command)


@handle_errors
def check_command(
    recipe: RecipeOpt = DEFAULT_RECIPE,
    set_: SetOpt = None,
    cache_dir: CacheDirOpt = None,
    fp16_prompts: Annotated[
        int,
        typer.Option(
            "--fp16-prompts", help="HumanEval prompts for the fp16-vs-fp32 greedy agreement check (0 = skip)."
        ),
    ] = 20,
    max_new_tokens: Annotated[int, typer.Option("--max-new-tokens", help="Tokens per fp16 check prompt.")] = 64,
    bands: Annotated[
        bool,
        typer.Option(
            "--bands/--no-bands",
            help="fp16 emulation over every cache position, per band, with padded prefill chunks and a NaN-filled "
            "starting cache (as a card's retained buffers).",
        ),
    ] = True,
    json_: JsonOpt = False,
) -> None:
    """Prove the graphs accelerator-ready: fully static per specialization, allow-listed ops, no fp16 hazards
    in the graph patterns, fp16 emulation on prompts and across every position band of the cache.

    Exits 1 when any check fails; the prompt check fails below 95% identical greedy outputs or on any inf/NaN,
    a band below 95% teacher-forced argmax agreement, above 5% feature error, or on any inf/NaN. Long
    positions are only reached with a long cache: e.g. --set export.ctx_len=4096.
    """
    from dflash_cli.cache.store import Cache
    from dflash_cli.readiness import readiness_report
    from dflash_cli.recipe.schema import load_recipe
    from dflash_cli.stages.pipeline import build

    r = load_recipe(recipe, [*(set_ or []), "export.weights=all"])  # the fp16 emulation runs the export's graphs
    cache = Cache(cache_dir)
    # Held until the check ends (the result's locks), so `dflash cache clean` leaves what it reads alone. A QAIC
    # recipe's emulation runs the export's own graphs on ONNX Runtime: no SDK or card needed, so no compile.
    qaic = r.compile.backend == "qaic"
    result = build(r, cache, upto="compile" if (fp16_prompts or bands) and not qaic else "export", hold=True)
    fp32_engine = _fp32_engine_once(recipe, set_, r, cache, result)

    report = readiness_report(result.path("export"))
    doc = {"recipe": r.name, "readiness": report.to_dict()}
    console = err_console()
    if not json_:
        console.print(report.render_text(), markup=False, highlight=False)
    ok = report.ok
    if (fp16_prompts or bands) and _emulation_skipped(result.path("export"), doc, console):
        fp16_prompts, bands = 0, False
    if fp16_prompts:
        fp16_ok = _prompt_check(fp32_engine(), result, fp16_prompts, max_new_tokens, doc, console, json_)
        ok = ok and fp16_ok
    if bands:
        ok = _band_check(fp32_engine(), result.path("export"), doc, console, json_) and ok
    doc["ok"] = ok
    if json_:
        print_json(doc)
    if not ok:
        raise typer.Exit(1)


def _fp32_engine_once(recipe: str, set_: list[str] | None, r, cache, result):
    """A loader of the fp32 engine the emulation checks compare against, loaded at most once: the prompt check
    and the band check share it (loading it for each held both)."""

    @functools.cache
    def fp32_engine():
        from dflash_cli.decoding.engine import Artifacts, Engine
        from dflash_cli.recipe.schema import load_recipe

        if r.compile.backend != "qaic":
            return Engine.load(r, cache)
        sets = [*(set_ or []), "export.weights=all", "compile.backend=ort", "compile.ort.prefix_cache=false"]
        export = result.path("export")
        return Engine(load_recipe(recipe, sets), Artifacts(result.path("inject"), export, export, {}))

    return fp32_engine


def _emulation_skipped(export_dir, doc: dict, console) -> bool:
    """Whether the fp16 emulation would not fit in memory; if so, records and says why."""
    from dflash_cli.readiness.memory import emulation_does_not_fit

    too_big = emulation_does_not_fit(export_dir)
    if not too_big:
        return False
    doc["fp16_skipped"] = too_big
    console.print(f"fp16 emulation checks skipped: {too_big}", markup=False, highlight=False)
    console.print(
        "  hint: run `dflash check` on a host with more memory (the static checks above stand on their own)",
        markup=False,
        highlight=False,
    )
    return True


def _prompt_check(engine, result, fp16_prompts: int, max_new_tokens: int, doc: dict, console, json_: bool) -> bool:
    """fp16-vs-fp32 greedy agreement on `fp16_prompts` HumanEval prompts; records it in `doc`, returns whether
    it passed."""
    from dflash_cli.bench.datasets import load_dataset
    from dflash_cli.readiness.fp16_agreement import fp16_agreement
    from dflash_cli.readiness.logit_gap import LogitGap

    samples = load_dataset("humaneval", max_samples=fp16_prompts, seed=0)
    prompts = [engine.encode_prompt(s.turns[0]) for s in samples]
    agreement = fp16_agreement(
        engine,
        result.path("export"),
        prompts,
        max_new_tokens,
        progress=None
        if json_ or not console.is_terminal
        else lambda i, n: console.print(f"fp16 check {i}/{n}", end="\r"),
        logit_gap=LogitGap(result.path("inject") / "target"),
    )
    doc["fp16"] = agreement.to_dict()
    fp16_ok = agreement.rate >= 0.95 and not agreement.nonfinite
    if not json_:
        console.print(
            f"fp16 emulation: {agreement.identical}/{agreement.prompts} prompts identical to fp32 "
            f"({agreement.rate:.1%}), non-finite outputs: {agreement.nonfinite or 'none'} "
            f"-> {'ok' if fp16_ok else 'FAIL'}",
            markup=False,
            highlight=False,
        )
        if agreement.divergences:
            ranks = sorted({d["fp16_rank"] for d in agreement.divergences})
            console.print(
                f"  at the first differing token: largest fp32 logit gap "
                f"{doc['fp16']['max_divergence_gap']:.4f}, fp16 token's fp32 rank(s) {ranks}",
                markup=False,
                highlight=False,
            )
    return fp16_ok


def _band_check(engine, export_dir, doc: dict, console, json_: bool) -> bool:
    from dflash_cli.readiness.fp16_bands import corpus_tokens, fp16_bands

    tokens = corpus_tokens(lambda text: list(engine.tokenizer(text)["input_ids"]), engine.ctx_len)
    show = not json_ and console.is_terminal
    report = fp16_bands(
        engine,
        export_dir,
        tokens,
        progress=(lambda what, i, n: console.print(f"fp16 bands: {what} {i}/{n}", end="\r")) if show else None,
    )
    doc["fp16_bands"] = report.to_dict()
    if not json_:
        console.print(report.render_text(), markup=False, highlight=False)
        console.print(f"fp16 bands: {'ok' if report.ok else 'FAIL'}", markup=False, highlight=False)
    return report.ok
