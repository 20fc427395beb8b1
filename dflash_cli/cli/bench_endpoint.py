"""`dflash bench --endpoint URL`: the dataset against a running OpenAI-compatible server (vLLM, SGLang,
`dflash serve`), with a recipe also checking greedy text against plain decoding of it."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from dflash_cli.cli.common import err_console, show_settings

if TYPE_CHECKING:
    from dflash_cli.bench import BenchSettings, Sample


def bench_endpoint(
    url: str,
    model: str | None,
    samples: list[Sample],
    settings: BenchSettings,
    recipe_ref: str | None,
    overrides: list[str] | None,
    cache_dir: Path | None,
    *,
    timeout: float,
) -> dict[str, Any]:
    """Run the dataset against a server; with a recipe, build it and check greedy text against plain decoding."""
    from dflash_cli.bench.datasets import dataset_name
    from dflash_cli.bench.document import LATENCY_KEYS, SCHEMA_VERSION, _now, tool_commit
    from dflash_cli.bench.endpoint import Endpoint
    from dflash_cli.bench.endpoint_run import run_endpoint

    client = Endpoint(url, timeout=timeout)
    model = model or client.model()
    plain_text = _plain_decoder(recipe_ref, overrides, cache_dir, settings) if recipe_ref is not None else None
    show_settings(
        "dflash bench: endpoint",
        [
            ("endpoint", url),
            ("model", model),
            ("dataset", f"{settings.dataset} ({len(samples)} samples)"),
            ("repeat / warmup", f"{settings.repeat} / {settings.warmup}"),
            ("max_new_tokens", settings.max_new_tokens),
            ("temperature", settings.temperature),
            ("lossless check", recipe_ref or "off (pass --recipe)"),
            ("timeout", f"{timeout:g} s a request"),
        ],
    )
    console = err_console()

    def progress(done: int, total: int) -> None:
        console.print(f"endpoint [{done}/{total}]", markup=False, highlight=False)

    section = run_endpoint(client, model, samples, settings, plain_text=plain_text, on_progress=progress)
    ep = section["endpoint"]
    return {
        "schema_version": SCHEMA_VERSION,
        "timestamp": _now(),
        "tool_commit": tool_commit(),
        "settings": {**settings.comparable(), "endpoint": url, "model": model, "recipe": recipe_ref},
        "dataset": {
            "name": dataset_name(settings.dataset),
            "spec": settings.dataset,
            "n_samples": len(samples),
            "sample_ids": [s.id for s in samples],
        },
        **section,
        **{k: v for k, v in ep.items() if k.startswith("spec_decode_") or k in LATENCY_KEYS},
        "mean_acceptance_length": ep.get("mean_acceptance_length"),
    }


def bench_load(
    url: str,
    model: str | None,
    samples: list[Sample],
    settings: BenchSettings,
    recipe_ref: str | None,
    overrides: list[str] | None,
    cache_dir: Path | None,
    *,
    timeout: float,
    levels: list[int],
    request_rate: float,
) -> dict[str, Any]:
    """The dataset's first turns as concurrent requests (bench/load.py); with a recipe, greedy texts are
    checked against its plain decoding."""
    from dflash_cli.bench.datasets import dataset_name
    from dflash_cli.bench.document import SCHEMA_VERSION, _now, tool_commit
    from dflash_cli.bench.endpoint import Endpoint
    from dflash_cli.bench.load import run_load

    client = Endpoint(url, timeout=timeout)
    model = model or client.model()
    show_settings(
        "dflash bench: endpoint under load",
        [
            ("endpoint", url),
            ("model", model),
            ("dataset", f"{settings.dataset} ({len(samples)} samples x {settings.repeat})"),
            ("concurrency", ", ".join(map(str, levels))),
            ("request rate", f"{request_rate:g}/s" if request_rate != float("inf") else "all at once"),
            ("max_new_tokens / temperature", f"{settings.max_new_tokens} / {settings.temperature}"),
            ("lossless check", recipe_ref or "off (pass --recipe)"),
        ],
    )
    console = err_console()

    def progress(done: int, total: int) -> None:
        if done == total or done % max(1, total // 10) == 0:
            console.print(f"load [{done}/{total}]", markup=False, highlight=False)

    loads = []
    for n in levels:
        console.print(f"{n} concurrent", markup=False, highlight=False)
        loads.append(run_load(client, model, samples, settings, n, request_rate, on_progress=progress))
    mismatches = []
    if recipe_ref is not None and settings.temperature == 0:
        from dflash_cli.bench.endpoint_run import text_mismatch

        plain_text = _plain_decoder(recipe_ref, overrides, cache_dir, settings)
        wants = {}
        for load in loads:
            for sample, text in zip([s for s in samples for _ in range(settings.repeat)], load["texts"]):
                if text is None:
                    continue
                if sample.id not in wants:
                    wants[sample.id] = plain_text([{"role": "user", "content": sample.turns[0]}])
                if wants[sample.id] != text:
                    mismatches.append(text_mismatch(sample.id, 0, wants[sample.id], text))
    return {
        "schema_version": SCHEMA_VERSION,
        "timestamp": _now(),
        "tool_commit": tool_commit(),
        "settings": {**settings.comparable(), "endpoint": url, "model": model, "recipe": recipe_ref},
        "dataset": {"name": dataset_name(settings.dataset), "spec": settings.dataset, "n_samples": len(samples)},
        "load": loads,
        "lossless": {"checked": recipe_ref is not None and settings.temperature == 0, "mismatches": mismatches},
    }


LOAD_ROWS = (
    ("completed / failed", lambda d: f"{d['completed']} / {d['failed']}"),
    ("duration", lambda d: f"{d['duration']:.1f} s"),
    ("output tokens/s", lambda d: f"{d['output_throughput']:.1f}"),
    ("requests/s", lambda d: f"{d['request_throughput']:.2f}"),
    ("TTFT median / p99", lambda d: f"{d.get('median_ttft_ms', 0):.0f} / {d.get('p99_ttft_ms', 0):.0f} ms"),
    ("TPOT median / p99", lambda d: f"{d.get('median_tpot_ms', 0):.1f} / {d.get('p99_tpot_ms', 0):.1f} ms"),
    ("E2E median / p99", lambda d: f"{d.get('median_e2el_ms', 0):.0f} / {d.get('p99_e2el_ms', 0):.0f} ms"),
)


def show_load(doc: dict[str, Any], fmt: str) -> None:
    from rich.table import Table

    from dflash_cli.cli.common import out_console, print_json

    if fmt == "json":
        print_json(doc)
        return
    loads = doc["load"]
    table = Table(title=f"under load (request rate {loads[0]['request_rate']})")
    table.add_column("concurrent requests")
    for load in loads:
        table.add_column(str(load["max_concurrency"]), justify="right")
    for name, value in LOAD_ROWS:
        table.add_row(name, *(value(load) for load in loads))
    out_console().print(table)
    for load in loads:
        for failure in load["failures"]:
            err_console().print(f"failed: {failure}", markup=False, highlight=False)
    checked = doc["lossless"]["checked"]
    bad = len(doc["lossless"]["mismatches"])
    out_console().print(f"lossless: {'not checked' if not checked else 'ok' if not bad else f'{bad} mismatch(es)'}")


def endpoint_command(url, model, samples, settings, recipe_ref, overrides, cache_dir, timeout, load) -> dict:
    """`bench --endpoint`'s document: one request at a time, or under `load` ({levels, request_rate})."""
    if load is None:
        return bench_endpoint(url, model, samples, settings, recipe_ref, overrides, cache_dir, timeout=timeout)
    return bench_load(url, model, samples, settings, recipe_ref, overrides, cache_dir, timeout=timeout, **load)


def finish_load(doc: dict, fmt: str, output: Path | None, plot: Path | None, write_json) -> None:
    """Write --output and --plot, show the load table, then fail on a lossless mismatch (exit 3)."""
    from dflash_cli.bench import check_lossless
    from dflash_cli.bench.plot import write_plot
    from dflash_cli.errors import DFlashError

    for load in doc["load"]:
        if not load["completed"]:
            raise DFlashError(
                f"every request failed at {load['max_concurrency']} concurrent: {load['failures'][0]}",
                hint="see the server's answer above; fix the request or the server",
            )
    if output is not None:
        write_json(output, doc)
    if plot is not None:
        write_plot(doc, plot)
    show_load(doc, fmt)
    check_lossless(doc)


def _plain_decoder(recipe_ref: str, overrides: list[str] | None, cache_dir: Path | None, settings: BenchSettings):
    """messages -> the recipe's plain greedy text for them (built first where needed): the lossless reference."""
    from dflash_cli.cache.store import Cache
    from dflash_cli.cli.build import build_progress
    from dflash_cli.decoding.engine import build_engine
    from dflash_cli.recipe.schema import load_recipe

    with build_progress() as on_event:
        engine = build_engine(load_recipe(recipe_ref, overrides or []), Cache(cache_dir), on_event)

    def plain_text(messages: list[dict]) -> str:
        ids = engine.encode_chat(messages)
        return engine.decode(engine.generate(ids, mode="plain", max_new_tokens=settings.max_new_tokens).tokens)

    return plain_text
