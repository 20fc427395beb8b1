"""`dflash run --prompt TEXT`: generate with the built pair, streaming text as tokens are committed."""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Annotated

import typer

from dflash_cli.cli.common import (
    CacheDirOpt,
    JsonOpt,
    RecipeArg,
    RecipeOpt,
    SetOpt,
    err_console,
    examples,
    handle_errors,
    pick_recipe,
    print_json,
)
from dflash_cli.decoding.modes import ALIASES, MODES, MODES_INFO
from dflash_cli.decoding.text_stream import TextStream
from dflash_cli.recipe.schema import DEFAULT_RECIPE


def register(app: typer.Typer) -> None:
    app.command(
        "run",
        epilog=examples(
            'dflash run --prompt "def fibonacci(n):"',
            'dflash run -r demo --prompt "import os" --max-new-tokens 64 --json',
            'dflash run --prompt "class Stack:" --no-draft   # plain decoding of the same target',
            'dflash run -r demo --set export.logits=true --prompt "def f(x):" --temperature 0.8 --seed 1',
            'dflash run -r my-qwen3-vl.yaml --image cat.png --prompt "What is in this picture?"',
        ),
    )(run_command)


@handle_errors
def run_command(
    ctx: typer.Context,
    prompt: Annotated[
        str,
        typer.Option(
            "--prompt",
            "-p",
            help="Text to continue (the chat template applies when the recipe enables it); `-` reads stdin.",
        ),
    ],
    recipe_arg: RecipeArg = None,
    recipe: RecipeOpt = DEFAULT_RECIPE,
    set_: SetOpt = None,
    cache_dir: CacheDirOpt = None,
    max_new_tokens: Annotated[
        int | None, typer.Option("--max-new-tokens", min=1, help="Default: run.max_new_tokens.")
    ] = None,
    temperature: Annotated[
        float | None, typer.Option("--temperature", min=0.0, help="0 = greedy. Default: run.temperature.")
    ] = None,
    top_k: Annotated[int | None, typer.Option("--top-k", min=0, help="Default: run.top_k (0 = off).")] = None,
    top_p: Annotated[
        float | None, typer.Option("--top-p", min=0.0, max=1.0, help="Default: run.top_p (1 = off).")
    ] = None,
    seed: Annotated[int | None, typer.Option("--seed", help="Sampling seed. Default: run.seed.")] = None,
    repetition_penalty: Annotated[
        float | None,
        typer.Option("--repetition-penalty", min=0.0, help="Seen tokens' logits / this (1 = off). Default: run.*."),
    ] = None,
    mode: Annotated[
        str | None,
        typer.Option(
            "--mode",
            metavar="|".join(MODES),
            help="Who drafts. " + "; ".join(f"{m.name}: {m.help}" for m in MODES_INFO) + ". Default: run.drafter.",
        ),
    ] = None,
    no_draft: Annotated[bool, typer.Option("--no-draft", help="Plain decoding (same as --mode plain).")] = False,
    image: Annotated[
        list[Path] | None,
        typer.Option(
            "--image",
            "-i",
            help="A local image for a vision-language target (repeat for several; they precede the prompt text).",
        ),
    ] = None,
    stop: Annotated[
        list[str] | None,
        typer.Option(
            "--stop",
            help="End the answer where this text appears, which is not printed (repeat for several; "
            "replaces run.stop; \\n and \\t are read as a newline and a tab).",
        ),
    ] = None,
    json_schema: Annotated[
        Path | None,
        typer.Option("--json-schema", help="Answer as JSON following this JSON schema file (needs export.logits)."),
    ] = None,
    regex: Annotated[
        str | None, typer.Option("--regex", help="Answer with text this regular expression matches whole.")
    ] = None,
    json_: JsonOpt = False,
) -> None:
    """Generate from a prompt with DFlash (or plain decoding with --no-draft); builds missing stages first."""
    recipe = pick_recipe(ctx, recipe_arg, recipe)
    decode_mode = resolve_mode(mode)
    if no_draft:
        if decode_mode not in (None, "plain"):
            raise typer.BadParameter(
                f"--no-draft means plain decoding but --mode {mode} was given; pass one of them",
                param_hint="--mode / --no-draft",
            )
        decode_mode = "plain"
    from dflash_cli.cache.store import Cache
    from dflash_cli.cli.build import build_progress
    from dflash_cli.decoding.engine import build_engine
    from dflash_cli.recipe.schema import load_recipe

    prompt = _read_prompt(prompt)
    r = load_recipe(recipe, set_ or [])
    run = r.run
    decode_mode = decode_mode or run.drafter  # a speculative mode's own name
    stops = _stops(stop, list(run.stop))
    constraint = _constraint(json_schema, regex)
    with build_progress() as on_event:
        # Same as `dflash bench`: stages not yet built are built (progress on stderr); cached ones are silent.
        engine = build_engine(r, Cache(cache_dir), lambda e: None if e.message == "cached" else on_event(e))
    images = None
    if image:
        ids, images = engine.encode_with_images(prompt, [str(p) for p in image])
    else:
        ids = engine.encode_prompt(prompt)
    stream = TextStream(engine.decode, stops)

    def on_commit(new: list[int]) -> str | None:
        delta = stream.push(new)
        if delta and not json_:
            sys.stdout.write(delta)
            sys.stdout.flush()
        return "stop_string" if stream.stopped else None  # generation ends at the step that wrote it

    result = engine.generate(
        ids,
        mode=decode_mode,
        max_new_tokens=run.max_new_tokens if max_new_tokens is None else max_new_tokens,
        temperature=run.temperature if temperature is None else temperature,
        top_k=run.top_k if top_k is None else top_k,
        top_p=run.top_p if top_p is None else top_p,
        seed=run.seed if seed is None else seed,
        repetition_penalty=run.repetition_penalty if repetition_penalty is None else repetition_penalty,
        on_commit=on_commit,
        images=images,
        constraint=constraint,
    )
    tail = stream.finish()
    if json_:
        print_json(
            {
                "recipe": r.name,
                "mode": result.mode,
                "prompt_tokens": result.prompt_tokens,
                "text": stream.text,
                "token_ids": result.tokens,
                "acceptance_lengths": result.accept_lengths,
                "tau": result.tau,
                "new_tokens": result.new_tokens,
                "ttft_s": result.prefill_s,
                "decode_s": result.decode_s,
                "decode_tokens_per_s": result.decode_tokens_per_s,
                "stopped": result.stopped,
            }
        )
        return
    sys.stdout.write(tail + "\n")
    sys.stdout.flush()
    err_console().print(
        f"{result.new_tokens} new tokens · tau {result.tau:.2f} · {result.decode_tokens_per_s:.1f} tok/s decode · "
        f"TTFT {result.prefill_s * 1000:.0f} ms · {result.mode} · stopped: {result.stopped}",
        markup=False,
        highlight=False,
    )


def resolve_mode(name: str | None) -> str | None:
    """A --mode value as its mode's one name (an old name, ALIASES, is accepted); None = the recipe's drafter."""
    from dflash_cli.recipe.schema import did_you_mean

    if name is None:
        return None
    name = ALIASES.get(name, name)
    if name not in MODES:
        raise typer.BadParameter(
            f"unknown mode {name!r}{did_you_mean(name, MODES)} (one of: {', '.join(MODES)})", param_hint="--mode"
        )
    return name


def _read_prompt(prompt: str) -> str:
    """`-` reads stdin; any prompt must be valid UTF-8 (argv bytes that are not arrive as surrogates)."""
    import sys

    from dflash_cli.errors import GenerationError

    hint = "pass UTF-8 text (check the terminal or file encoding)"
    if prompt == "-":
        stdin_hint = 'pipe the prompt in (echo "def f(x):" | dflash run -p -) or pass --prompt TEXT'
        stream = getattr(sys.stdin, "buffer", sys.stdin)  # None when the process was started with stdin closed
        if stream is None:
            raise GenerationError("--prompt - reads stdin, but stdin is closed", hint=stdin_hint)
        try:
            data = stream.read()
        except (OSError, ValueError) as exc:  # a closed descriptor or file object
            raise GenerationError(f"cannot read the prompt from stdin: {exc}", hint=stdin_hint) from None
        if isinstance(data, str):
            data = data.encode("utf-8", "surrogateescape")
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise GenerationError(f"the prompt on stdin is not valid UTF-8 (byte {exc.start})", hint=hint) from None
        if not text.strip():
            raise GenerationError("the prompt on stdin is empty", hint=stdin_hint)
        return text
    try:
        prompt.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise GenerationError(f"the prompt is not valid UTF-8 (character {exc.start})", hint=hint) from None
    return prompt


def _stops(given: list[str] | None, recipe_stops: list[str]) -> list[str]:
    """--stop values (replacing run.stop) with \\n, \\t, \\r and \\\\ read as escapes: a shell passes them as typed."""
    if given is None:
        return recipe_stops
    escapes = {"n": "\n", "t": "\t", "r": "\r", "\\": "\\"}
    stops = [re.sub(r"\\([ntr\\])", lambda m: escapes[m.group(1)], s) for s in given]
    if any(s == "" for s in stops):
        raise typer.BadParameter("a stop string must not be empty", param_hint="--stop")
    return stops


def _constraint(schema_file: Path | None, regex: str | None):
    """--json-schema FILE or --regex R as the ConstraintSpec decoding follows (None: neither)."""
    import json

    from dflash_cli.decoding.constraint import ConstraintSpec
    from dflash_cli.errors import GenerationError

    if schema_file is not None and regex is not None:
        raise typer.BadParameter("give --json-schema or --regex, not both", param_hint="--json-schema / --regex")
    if regex is not None:
        return ConstraintSpec("regex", regex)
    if schema_file is None:
        return None
    try:
        schema = json.loads(schema_file.read_text(encoding="utf-8"))
    except OSError as exc:
        why = f"cannot read the JSON schema {schema_file}: {exc.strerror or exc}"
        raise GenerationError(why, hint="pass the path of a JSON schema file") from None
    except ValueError as exc:
        raise GenerationError(f"{schema_file} is not JSON: {exc}", hint="a JSON schema is a JSON object") from None
    if not isinstance(schema, dict):
        raise GenerationError(f"{schema_file} holds no JSON object", hint="a JSON schema is a JSON object")
    return ConstraintSpec("json_schema", schema)
