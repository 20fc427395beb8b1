"""`dflash serve`: build the recipe if needed, then serve it on an OpenAI-compatible HTTP API."""

from __future__ import annotations

from typing import Annotated

import typer

from dflash_cli.cli.common import (
    CacheDirOpt,
    RecipeArg,
    RecipeOpt,
    SetOpt,
    err_console,
    examples,
    handle_errors,
    pick_recipe,
)
from dflash_cli.recipe.schema import DEFAULT_RECIPE
from dflash_cli.serve.handoff import ENGINES


def register(app: typer.Typer) -> None:
    app.command(
        "serve",
        epilog=examples(
            "dflash serve --recipe demo                      # http://127.0.0.1:8000/v1",
            "dflash serve -r qwen3-8b --host 0.0.0.0 --port 8080 --queue-size 16",
            "dflash serve -r qwen3-8b --print-command vllm   # the same pair in vLLM",
            'curl -s localhost:8000/v1/completions -d \'{"model": "demo", "prompt": "def f(x):", "max_tokens": 32}\'',
        ),
    )(serve_command)


@handle_errors
def serve_command(
    ctx: typer.Context,
    recipe_arg: RecipeArg = None,
    recipe: RecipeOpt = DEFAULT_RECIPE,
    set_: SetOpt = None,
    cache_dir: CacheDirOpt = None,
    host: Annotated[str | None, typer.Option("--host", help="Address to listen on. Default: serve.host.")] = None,
    port: Annotated[
        int | None, typer.Option("--port", min=0, max=65535, help="0 = any free port. Default: serve.port.")
    ] = None,
    queue_size: Annotated[
        int | None,
        typer.Option(
            "--queue-size", min=0, help="Requests waiting while one runs (more get 503). Default: serve.queue_size."
        ),
    ] = None,
    max_batch: Annotated[
        int | None,
        typer.Option(
            "--max-batch", min=1, max=64, help="Requests decoded together (1: one at a time). Default: serve.max_batch."
        ),
    ] = None,
    model_name: Annotated[
        str | None, typer.Option("--model-name", help="The model id clients send. Default: the recipe's name.")
    ] = None,
    no_draft: Annotated[bool, typer.Option("--no-draft", help="Serve plain decoding of the same target.")] = False,
    print_command: Annotated[
        str | None,
        typer.Option("--print-command", metavar="vllm|sglang", help="Print the command serving this pair there; exit."),
    ] = None,
    access_log: Annotated[bool, typer.Option("--access-log", help="Log every HTTP request.")] = False,
    graceful_timeout: Annotated[
        float,
        typer.Option(
            "--graceful-timeout",
            min=0.0,
            help="Seconds a stop waits for requests in flight; then they get an error (streams: a final chunk).",
        ),
    ] = 30.0,
) -> None:
    """Serve the built pair on an OpenAI-compatible API (/v1/completions, /v1/chat/completions, /metrics)."""
    from dflash_cli.recipe.schema import did_you_mean, load_recipe

    recipe = pick_recipe(ctx, recipe_arg, recipe)
    if print_command is not None and print_command not in ENGINES:
        raise typer.BadParameter(
            f"unknown engine {print_command!r}{did_you_mean(print_command, ENGINES)} (one of: {', '.join(ENGINES)})",
            param_hint="--print-command",
        )
    r = load_recipe(recipe, set_ or [])
    name = model_name or r.name
    if print_command:
        from dflash_cli.serve.handoff import handoff_command

        typer.echo(handoff_command(r, print_command, name))
        return

    from dflash_cli.cache.store import Cache
    from dflash_cli.cli.build import build_progress
    from dflash_cli.decoding.engine import build_engine
    from dflash_cli.serve.app import create_app
    from dflash_cli.serve.server import bind, build_server, serve_forever

    host = r.serve.host if host is None else host
    queue = r.serve.queue_size if queue_size is None else queue_size
    sock = bind(host, r.serve.port if port is None else port)
    with build_progress() as on_event:
        engine = build_engine(r, Cache(cache_dir), lambda e: None if e.message == "cached" else on_event(e))
    mode = "plain" if no_draft else r.run.drafter  # run.drafter names a speculative mode
    app = create_app(
        engine,
        model_name=name,
        queue_size=queue,
        mode=mode,
        max_request_bytes=r.serve.max_request_bytes,
        max_batch=r.serve.max_batch if max_batch is None else max_batch,
    )
    scheduler = app.state.scheduler
    if scheduler.batch_check is not None and scheduler.batch_check["equal"]:
        note = "the build could not check batch invariance (memory); checked at start: equal"
        err_console().print(f"note: {note}", markup=False, highlight=False)
    if scheduler.batch_refusal:
        err_console().print(f"note: batch {scheduler.slots}: {scheduler.batch_refusal}", markup=False, highlight=False)
    batch = f"batch {scheduler.slots}" if scheduler.slots > 1 else "one at a time"
    shown = f"[{host}]" if ":" in host else host
    err_console().print(
        f"serving {name} ({mode}) on http://{shown}:{sock.getsockname()[1]}/v1 · {batch} · queue {queue} · "
        "Ctrl-C stops",
        markup=False,
        highlight=False,
    )
    try:
        serve_forever(build_server(app, access_log=access_log, graceful_s=graceful_timeout), sock)
    finally:
        app.state.scheduler.close()
    err_console().print("stopped", markup=False, highlight=False)
