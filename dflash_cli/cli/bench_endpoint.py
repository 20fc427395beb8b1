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
    from dflash_cli.bench.endpoint import Endpoint, run_endpoint

    client = Endpoint(url, timeout=timeout)
    model = model or client.model()
    plain_text = None
    if recipe_ref is not None:
        from dflash_cli.cache import Cache
        from dflash_cli.cli.build import build_progress
        from dflash_cli.decoding.engine import build_engine
        from dflash_cli.recipe import load_recipe

        with build_progress() as on_event:
            engine = build_engine(load_recipe(recipe_ref, overrides or []), Cache(cache_dir), on_event)

        def plain_text(messages: list[dict]) -> str:
            ids = engine.encode_chat(messages)
            return engine.decode(engine.generate(ids, mode="plain", max_new_tokens=settings.max_new_tokens).tokens)

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
            ("timeout", f"{timeout:g} s idle"),
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
