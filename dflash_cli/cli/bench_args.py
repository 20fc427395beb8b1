"""`dflash bench`'s option values checked before any benchmarking: modes, block sizes, output paths, floors."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from dflash_cli.cli.common import err_console
from dflash_cli.decoding.modes import ALIASES, MODES
from dflash_cli.errors import DFlashError


def parse_modes(text: str) -> tuple[str, ...]:
    """The modes by their one names; an old name (ALIASES) is accepted and said so."""
    given = tuple(m.strip() for m in text.split(",") if m.strip())
    modes = tuple(ALIASES.get(m, m) for m in given)
    bad = [m for m in modes if m not in MODES]
    if not modes or bad or len(set(modes)) != len(modes):
        raise DFlashError(f"invalid --modes {text!r}", hint=f"comma-separated, distinct, among {','.join(MODES)}")
    for old in dict.fromkeys(m for m in given if m in ALIASES):
        err_console().print(f"--modes: {old} is {ALIASES[old]}'s old name; reported as {ALIASES[old]}", markup=False)
    return modes


def parse_block_sizes(text: str) -> list[int]:
    try:
        sizes = [int(part) for part in text.split(",")]  # an empty item (4,,8) is an error, not skipped
    except ValueError:
        sizes = []
    if not sizes or any(b < 2 for b in sizes) or len(set(sizes)) != len(sizes):
        raise DFlashError(f"invalid --block-sizes {text!r}", hint="distinct integers >= 2, e.g. --block-sizes 4,8,16")
    return sizes


def check_writable(path: Path, flag: str) -> None:
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


def check_floor_modes(modes: tuple[str, ...], min_speedup: float | None, min_tau: float | None) -> None:
    # Refuse before hours of benchmarking a floor that this run cannot measure.
    if min_speedup is not None and not {"plain", "dflash"} <= set(modes):
        raise DFlashError("--min-speedup needs the plain and dflash modes", hint="add them to --modes")
    if min_tau is not None and "dflash" not in modes:
        raise DFlashError("--min-tau needs the dflash mode", hint="add dflash to --modes")


ConcurrencyOpt = Annotated[
    str | None,
    typer.Option(
        "--concurrency",
        metavar="N[,N...]",
        help="With --endpoint: send the samples' first turns as up to N requests at once and report throughput "
        "and latency percentiles (vllm bench serve's fields); several levels, e.g. 1,2,4,8, run one after another.",
    ),
]

PlotOpt = Annotated[
    Path | None,
    typer.Option(
        "--plot",
        metavar="FILE",
        help="Draw per-position acceptance, per-prompt speedups and (with --concurrency) load curves into FILE: "
        ".html (self-contained) or .png (needs matplotlib: the `plot` extra).",
    ),
]


def parse_levels(text: str) -> list[int]:
    try:
        levels = [int(part) for part in text.split(",")]
    except ValueError:
        levels = []
    if not levels or any(n < 1 for n in levels):
        raise DFlashError(f"invalid --concurrency {text!r}", hint="positive integers, e.g. --concurrency 1,2,4,8")
    return levels


RequestRateOpt = Annotated[
    float,
    typer.Option(
        "--request-rate",
        min=0.001,
        help="With --concurrency: requests per second arriving as a Poisson process (seeded; default: all at once).",
    ),
]
EndpointOpt = Annotated[
    str | None,
    typer.Option(
        "--endpoint",
        metavar="URL",
        help="Benchmark an OpenAI-compatible server (vLLM, SGLang, dflash serve) instead of a local engine; "
        "with --recipe too, greedy text is checked against that recipe's plain decoding.",
    ),
]
ModelOpt = Annotated[
    str | None, typer.Option("--model", help="With --endpoint: the model name to request (default: the first served).")
]
TimeoutOpt = Annotated[
    float,
    typer.Option(
        "--timeout",
        metavar="SECONDS",
        min=0.001,
        help="With --endpoint: fail a request that has not finished SECONDS after it began, connecting included "
        "(a cap on the whole request, so a server trickling keep-alives cannot hold bench; default 600).",
    ),
]
