"""`dflash bench`: plain decoding vs DFlash (and prompt lookup) on a dataset, in one interleaved run.

Parses options, builds/loads the engine per block size, and delegates to dflash_cli.bench;
tables go to stdout (or one JSON document with --json), progress to stderr.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

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
from dflash_cli.errors import DFlashError
from dflash_cli.recipe import DEFAULT_RECIPE

if TYPE_CHECKING:  # the bench library is imported inside the command, keeping `dflash --help` fast
    from dflash_cli.bench import BenchSettings, Sample

_HELP = """Benchmark plain decoding vs DFlash (and prompt lookup) on the same prompts.

Every sample runs in each mode back-to-back, the order alternating per sample, so machine noise \
hits all modes alike. Decode speedup = plain time-per-output-token / DFlash time-per-output-token, \
prefill excluded. At temperature 0 every mode must match plain greedy decoding token for token.

--max-samples N picks random.Random(SEED).sample(range(size), N) and keeps dataset order. \
Each finished sample is appended to a JSONL results file; --resume skips the finished ones.

Exit codes: 0 ok, 1 error, 3 lossless mismatch (greedy DFlash/PLD output differed from plain), \
4 a --min-speedup / --min-tau floor was not met.
"""

_EPILOG = (
    "Examples: dflash bench -r demo --max-samples 20    |    "
    "dflash bench -r qwen3-8b --dataset ./gsm8k.jsonl --json --min-speedup 2    |    "
    "dflash bench -r demo --block-sizes 4,8,16"
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
    str, typer.Option("--modes", help="Comma-separated modes among plain,dflash,pld (plain is the baseline).")
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
    modes: ModesOpt = "plain,dflash,pld",
    json_: JsonOpt = False,
    output: OutputOpt = None,
    results: ResultsOpt = None,
    resume: ResumeOpt = False,
    min_speedup: MinSpeedupOpt = None,
    min_tau: MinTauOpt = None,
    block_sizes: BlockSizesOpt = None,
) -> None:
    from dflash_cli.bench import BenchSettings, load_dataset

    mode_list = _parse_modes(modes)
    sizes: list[int | None] = _parse_block_sizes(block_sizes) if block_sizes else [None]
    _check_floor_modes(mode_list, min_speedup, min_tau)
    for path, flag in ((results, "--results"), (output, "--output")):
        if path is not None:
            _check_writable(path, flag)
    samples = load_dataset(dataset, max_samples=max_samples, seed=seed)  # fail on a bad dataset before building
    if max_new_tokens is None:
        from dflash_cli.recipe import load_recipe

        max_new_tokens = load_recipe(recipe, set_ or []).run.max_new_tokens
    settings = BenchSettings(
        dataset=dataset, max_new_tokens=max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed
    )
    docs: dict[int, dict[str, Any]] = {}
    for size in sizes:
        overrides = [*(set_ or []), *([f"dflash.block_size={size}"] if size is not None else [])]
        block, doc = _bench_one(recipe, overrides, cache_dir, samples, settings, mode_list, results, resume, sweep=size)
        docs[block] = doc
    _finish(docs, as_json=json_, output=output, min_speedup=min_speedup, min_tau=min_tau)


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
    from dflash_cli.cache import Cache
    from dflash_cli.cli.build import build_progress
    from dflash_cli.decoding.engine import build_engine
    from dflash_cli.recipe import load_recipe

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
    as_json: bool,
    output: Path | None,
    min_speedup: float | None,
    min_tau: float | None,
) -> None:
    """Report (JSON or tables), write --output, then fail on mismatches (3) or floors (4)."""
    from dflash_cli.bench import build_sweep_document, check_floors, check_lossless
    from dflash_cli.bench.report import report_renderables

    doc = next(iter(docs.values())) if len(docs) == 1 else build_sweep_document(docs)
    if output is not None:
        _write_json(output, doc)
    if as_json:
        print_json(doc)
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


def _parse_modes(text: str) -> tuple[str, ...]:
    from dflash_cli.bench.runner import MODES

    modes = tuple(m.strip() for m in text.split(",") if m.strip())
    bad = [m for m in modes if m not in MODES]
    if not modes or bad or len(set(modes)) != len(modes):
        raise DFlashError(f"invalid --modes {text!r}", hint=f"comma-separated, distinct, among {','.join(MODES)}")
    return modes


def _parse_block_sizes(text: str) -> list[int]:
    try:
        sizes = [int(part) for part in text.split(",")]  # an empty item (4,,8) is an error, not skipped
    except ValueError:
        sizes = []
    if not sizes or any(b < 2 for b in sizes) or len(set(sizes)) != len(sizes):
        raise DFlashError(f"invalid --block-sizes {text!r}", hint="distinct integers >= 2, e.g. --block-sizes 4,8,16")
    return sizes


def _check_writable(path: Path, flag: str) -> None:
    """Refuse a results/output path that cannot be written, before any benchmarking (root ignores mode bits,
    so this tries a real write next to it)."""
    import tempfile

    if path.is_dir():
        raise DFlashError(f"{flag} {path} is a directory", hint=f"pass a file path, e.g. {flag} {path / 'bench.jsonl'}")
    parent = path.parent if str(path.parent) else Path(".")
    try:
        parent.mkdir(parents=True, exist_ok=True)
        if path.exists():
            with path.open("a"):
                pass
        else:
            with tempfile.NamedTemporaryFile(dir=parent, prefix=".dflash-probe-"):
                pass
    except (FileExistsError, NotADirectoryError):
        raise DFlashError(
            f"{flag} {path}: a parent of it is a file, not a directory", hint=f"pass a writable path to {flag}"
        ) from None
    except OSError as exc:
        raise DFlashError(
            f"{flag} {path} is not writable: {exc.strerror or exc}", hint=f"pass a writable path to {flag}"
        ) from None


def _check_floor_modes(modes: tuple[str, ...], min_speedup: float | None, min_tau: float | None) -> None:
    # Refuse before hours of benchmarking a floor that this run cannot measure.
    if min_speedup is not None and not {"plain", "dflash"} <= set(modes):
        raise DFlashError("--min-speedup needs the plain and dflash modes", hint="add them to --modes")
    if min_tau is not None and "dflash" not in modes:
        raise DFlashError("--min-tau needs the dflash mode", hint="add dflash to --modes")
