"""`dflash bench`: plain decoding vs DFlash (and prompt lookup) on a dataset, in one interleaved run.

Parses options, builds/loads the engine per block size, and delegates to dflash_cli.bench;
tables go to stdout (or one JSON document with --json), progress to stderr.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from dflash_cli.bench.plot import write_plot
from dflash_cli.cli.bench_args import (
    ConcurrencyOpt,
    EndpointOpt,
    ModelOpt,
    PlotOpt,
    RequestRateOpt,
    TimeoutOpt,
    check_floor_modes,
    check_writable,
    parse_block_sizes,
    parse_levels,
    parse_modes,
)
from dflash_cli.cli.bench_compare import compare_documents, refuse_options_compare_ignores
from dflash_cli.cli.common import (
    CacheDirOpt,
    JsonOpt,
    RecipeOpt,
    SetOpt,
    err_console,
    handle_errors,
    out_console,
    print_json,
    show_settings,
)
from dflash_cli.decoding.modes import ALIASES, MODES
from dflash_cli.errors import DFlashError
from dflash_cli.recipe.schema import DEFAULT_RECIPE

if TYPE_CHECKING:  # the bench library is imported inside the command, keeping `dflash --help` fast
    from dflash_cli.bench import BenchSettings, Sample

_HELP = """Benchmark plain decoding vs DFlash (and prompt lookup) on the same prompts.

Every sample runs in each mode back-to-back, the order alternating per sample, so machine noise \
hits all modes alike. Decode speedup = plain time-per-output-token / DFlash time-per-output-token, \
prefill excluded. At temperature 0 every mode must match plain greedy decoding token for token.

--max-samples N picks random.Random(SEED).sample(range(size), N) and keeps dataset order. \
Each finished sample is appended to a JSONL results file; --resume skips the finished ones.

--repeat N runs each sample's modes N times; timings are reported with mean, median, p90, p99 and \
stddev, speedups with a 95% bootstrap interval over samples. `dflash bench compare A.json B.json` puts \
--output documents side by side. --endpoint URL benchmarks any OpenAI-compatible server instead.

Exit codes: 0 ok, 1 error, 3 lossless mismatch (a speculative mode's greedy output differed from plain), \
4 a --min-speedup / --min-tau floor was not met.
"""

_EPILOG = (
    "Examples: dflash bench -r demo --max-samples 20    |    "
    "dflash bench -r qwen3-8b --dataset ./gsm8k.jsonl --json --min-speedup 2    |    "
    "dflash bench -r demo --block-sizes 4,8,16    |    "
    "dflash bench compare run1.json run2.json    |    "
    "dflash bench --endpoint http://127.0.0.1:8000 --dataset gsm8k"
)

DatasetOpt = Annotated[
    str,
    typer.Option(
        "--dataset",
        "-d",
        help="Built-in dataset (humaneval) or a local .jsonl ({'turns': [...]} or {'prompt': ...} per line) "
        "or .txt (one prompt per line) file. gsm8k, math500, mbpp, mt-bench: pass their local JSONL.",
    ),
]
MaxSamplesOpt = Annotated[
    int | None,
    typer.Option(
        "--max-samples",
        min=1,
        help="Use N samples: a seeded random choice (see above), kept in dataset order.",
    ),
]
SeedOpt = Annotated[int, typer.Option("--seed", help="Seed for the sample choice and for sampling.")]
MaxNewTokensOpt = Annotated[
    int | None,
    typer.Option(
        "--max-new-tokens", min=1, help="Tokens to generate per turn (default: the recipe's run.max_new_tokens)."
    ),
]
TemperatureOpt = Annotated[
    float, typer.Option("--temperature", min=0.0, help="0 = greedy (losslessness is checked only then).")
]
TopKOpt = Annotated[int, typer.Option("--top-k", min=0, help="Top-k sampling (0 = off).")]
TopPOpt = Annotated[float, typer.Option("--top-p", min=0.0, max=1.0, help="Top-p sampling (1 = off).")]
ModesOpt = Annotated[
    str,
    typer.Option(
        "--modes",
        help=f"Comma-separated modes among {','.join(MODES)} (plain is the baseline; "
        f"{', '.join(f'{old} = {new}' for old, new in ALIASES.items())}, an old name).",
    ),
]
OutputOpt = Annotated[Path | None, typer.Option("--output", "-o", help="Also write the JSON document to FILE.")]
ResultsOpt = Annotated[
    Path | None,
    typer.Option(
        "--results",
        help="Per-sample JSONL results file (default: <cache-dir>/bench/<recipe>-<dataset>-b<B>.jsonl; "
        "with --block-sizes, -b<B> is added to a given name).",
    ),
]
ResumeOpt = Annotated[
    bool, typer.Option("--resume", help="Continue an interrupted run from its results file (same settings).")
]
MinSpeedupOpt = Annotated[
    float | None, typer.Option("--min-speedup", help="Fail (exit 4) when the decode speedup is below X.")
]
MinTauOpt = Annotated[
    float | None, typer.Option("--min-tau", help="Fail (exit 4) when the mean acceptance length is below X.")
]
WarmupOpt = Annotated[
    int, typer.Option("--warmup", min=0, help="Samples run first in every mode and discarded (default 1).")
]
RepeatOpt = Annotated[
    int,
    typer.Option("--repeat", min=1, help="Run each sample's modes N times (interleaved); timings report their spread."),
]
PlainBestOpt = Annotated[
    bool,
    typer.Option(
        "--plain-best/--plain-same",
        help="Plain (the baseline) on its own target session with spinning threads, its best CPU setting "
        "(default), or on the speculative modes' session.",
    ),
]
FormatOpt = Annotated[
    str | None,
    typer.Option("--format", metavar="table|md|csv|json", help="Report on stdout (default table; json = --json)."),
]
CompareArgs = Annotated[
    list[str] | None,
    typer.Argument(
        metavar="[compare A.json B.json ...]",
        help="`compare` and two or more `--output` documents: headline numbers side by side.",
        show_default=False,
    ),
]
FORMATS = ("table", "md", "csv", "json")
BlockSizesOpt = Annotated[
    str | None,
    typer.Option(
        "--block-sizes",
        metavar="B1,B2,...",
        help="Sweep block sizes (one engine each via --set dflash.block_size=B); reports each and the fastest.",
    ),
]


def register(app: typer.Typer) -> None:
    app.command("bench", help=_HELP, epilog=_EPILOG)(bench_command)


@handle_errors
def bench_command(
    ctx: typer.Context,
    compare_args: CompareArgs = None,
    dataset: DatasetOpt = "humaneval",
    recipe: RecipeOpt = DEFAULT_RECIPE,
    set_: SetOpt = None,
    cache_dir: CacheDirOpt = None,
    max_samples: MaxSamplesOpt = None,
    seed: SeedOpt = 0,
    max_new_tokens: MaxNewTokensOpt = None,
    temperature: TemperatureOpt = 0.0,
    top_k: TopKOpt = 0,
    top_p: TopPOpt = 1.0,
    modes: ModesOpt = "plain,dflash,lookup",
    json_: JsonOpt = False,
    output: OutputOpt = None,
    results: ResultsOpt = None,
    resume: ResumeOpt = False,
    min_speedup: MinSpeedupOpt = None,
    min_tau: MinTauOpt = None,
    block_sizes: BlockSizesOpt = None,
    warmup: WarmupOpt = 1,
    repeat: RepeatOpt = 1,
    plain_best: PlainBestOpt = True,
    format_: FormatOpt = None,
    endpoint: EndpointOpt = None,
    model: ModelOpt = None,
    timeout: TimeoutOpt = 600.0,
    concurrency: ConcurrencyOpt = None,
    request_rate: RequestRateOpt = float("inf"),
    plot: PlotOpt = None,
) -> None:
    from dflash_cli.bench import BenchSettings, load_dataset
    from dflash_cli.recipe.schema import did_you_mean

    if format_ is not None and format_ not in FORMATS:
        raise typer.BadParameter(
            f"unknown format {format_!r}{did_you_mean(format_, FORMATS)} (one of: {', '.join(FORMATS)})",
            param_hint="--format",
        )
    fmt = "json" if json_ else (format_ or "table")
    if compare_args:
        if compare_args[0] != "compare":
            raise typer.BadParameter(
                f"unexpected argument {compare_args[0]!r}; the only subcommand is `compare`", param_hint="ARGS"
            )
        refuse_options_compare_ignores(ctx)
        compare_documents([Path(a) for a in compare_args[1:]], fmt)
        return

    mode_list = parse_modes(modes)
    sizes: list[int | None] = parse_block_sizes(block_sizes) if block_sizes else [None]
    check_floor_modes(mode_list, min_speedup, min_tau)
    for path, flag in ((results, "--results"), (output, "--output"), (plot, "--plot")):
        if path is not None:
            check_writable(path, flag)
    samples = load_dataset(dataset, max_samples=max_samples, seed=seed)  # fail on a bad dataset before building
    recipe_given = ctx.get_parameter_source("recipe").name != "DEFAULT"
    if max_new_tokens is None:
        from dflash_cli.recipe.schema import load_recipe

        max_new_tokens = load_recipe(recipe, set_ or []).run.max_new_tokens
    settings = BenchSettings(
        dataset=dataset,
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        seed=seed,
        repeat=repeat,
        warmup=warmup,
        plain_best=plain_best,
    )
    if endpoint:
        from dflash_cli.cli.bench_endpoint import endpoint_command, finish_load

        ref = recipe if recipe_given else None
        load = {"levels": parse_levels(concurrency), "request_rate": request_rate} if concurrency else None
        doc = endpoint_command(endpoint, model, samples, settings, ref, set_, cache_dir, timeout, load)
        if load is None:
            _finish({0: doc}, fmt=fmt, output=output, min_speedup=None, min_tau=min_tau, plot=plot)
        else:
            finish_load(doc, fmt, output, plot, _write_json)
        return
    docs: dict[int, dict[str, Any]] = {}
    for size in sizes:
        overrides = [*(set_ or []), *([f"dflash.block_size={size}"] if size is not None else [])]
        block, doc = _bench_one(recipe, overrides, cache_dir, samples, settings, mode_list, results, resume, sweep=size)
        docs[block] = doc
    _finish(docs, fmt=fmt, output=output, min_speedup=min_speedup, min_tau=min_tau, plot=plot)


def _bench_one(
    recipe_ref: str,
    overrides: list[str],
    cache_dir: Path | None,
    samples: list[Sample],
    settings: BenchSettings,
    modes: tuple[str, ...],
    results: Path | None,
    resume: bool,
    *,
    sweep: int | None,
) -> tuple[int, dict[str, Any]]:
    """Build/load the engine for one block size, run the bench, return (block size, document)."""
    from dflash_cli.bench import ResultsLog, build_document, default_results_path, run_bench
    from dflash_cli.bench.datasets import dataset_name
    from dflash_cli.bench.report import LiveProgress
    from dflash_cli.cache.store import Cache
    from dflash_cli.cli.build import build_progress
    from dflash_cli.decoding.engine import build_engine
    from dflash_cli.recipe.schema import load_recipe

    recipe = load_recipe(recipe_ref, overrides)
    cache = Cache(cache_dir)
    with build_progress() as on_event:
        engine = build_engine(recipe, cache, on_event)  # builds the stages this block size still lacks
    block = int(engine.block_size)
    if results is None:
        path = default_results_path(cache.root, recipe.name, dataset_name(settings.dataset), block)
    else:
        path = results.with_name(f"{results.stem}-b{block}{results.suffix}") if sweep is not None else results
    turns = sum(len(s.turns) for s in samples)
    show_settings(
        f"dflash bench: {recipe.name}",
        [
            ("dataset", f"{settings.dataset} ({len(samples)} samples, {turns} turns)"),
            ("modes", ",".join(modes)),
            ("block_size", block),
            ("max_new_tokens", settings.max_new_tokens),
            ("temperature", settings.temperature),
            ("seed", settings.seed),
            ("provider", engine.provider),
            ("results", f"{path}{' (resume)' if resume else ''}"),
        ],
    )
    console = err_console()
    try:
        with LiveProgress(console, f"bench b={block}", live=console.is_terminal) as live:
            result = run_bench(
                engine,
                samples,
                settings,
                modes=modes,
                results_log=ResultsLog(path, resume=resume),
                on_progress=live.update,
            )
    except KeyboardInterrupt:
        console.print(f"results so far: {path} (rerun with --resume to continue)", markup=False, highlight=False)
        raise
    finally:
        close = getattr(engine, "close", None)
        if close is not None:
            close()  # release sessions before the next block size loads its own
    console.print(f"results: {path}", markup=False, highlight=False)
    return block, build_document(result)


def _finish(
    docs: dict[int, dict[str, Any]],
    *,
    fmt: str,
    output: Path | None,
    min_speedup: float | None,
    min_tau: float | None,
    plot: Path | None = None,
) -> None:
    """Report (tables, Markdown, CSV or JSON), write --output and --plot, then fail on mismatches (3) or floors (4)."""
    from dflash_cli.bench import build_sweep_document, check_floors, check_lossless
    from dflash_cli.bench.formats import to_csv, to_markdown
    from dflash_cli.bench.report import report_renderables

    doc = next(iter(docs.values())) if len(docs) == 1 else build_sweep_document(docs)
    if output is not None:
        _write_json(output, doc)
    if plot is not None:
        write_plot(doc, plot)
    if fmt == "json":
        print_json(doc)
    elif fmt in ("md", "csv"):
        sys.stdout.write(to_markdown(doc) if fmt == "md" else to_csv(doc))
    else:
        console = out_console()
        for part in report_renderables(doc):
            console.print(part)
    check_lossless(doc)
    check_floors(doc, min_speedup=min_speedup, min_tau=min_tau)


def _write_json(path: Path, doc: dict[str, Any]) -> None:
    # Write beside and rename, so a CI job never reads a half-written document.
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text(json.dumps(doc, indent=2, default=str) + "\n", encoding="utf-8")
        os.replace(tmp, path)
    except OSError as exc:
        raise DFlashError(
            f"cannot write {path}: {exc.strerror or exc}", hint="choose a writable --output path"
        ) from exc
