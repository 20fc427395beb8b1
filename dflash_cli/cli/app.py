"""The `dflash` Typer app: each command module in COMMAND_MODULES registers its commands.

Command modules import only typer, rich and light dflash modules at import time; torch, onnx and
transformers are imported inside the commands so `dflash --help` stays instant.
"""

from __future__ import annotations

import importlib

import typer

# Append a module (exposing `register(app: typer.Typer) -> None`) to add commands.
COMMAND_MODULES: tuple[str, ...] = (
    "dflash_cli.cli.build",
    "dflash_cli.cli.stages_cmd",
    "dflash_cli.cli.recipes",
    "dflash_cli.cli.cache_cmd",
    "dflash_cli.cli.doctor",
)


def create_app() -> typer.Typer:
    app = typer.Typer(
        name="dflash",
        help="Compile and run DFlash speculative decoding: convert -> inject -> export -> compile -> run / bench.",
        epilog="Start with: dflash doctor, then dflash build --recipe demo. DFLASH_DEBUG=1 shows tracebacks.",
        no_args_is_help=True,
        add_completion=False,
        pretty_exceptions_enable=False,
        context_settings={"help_option_names": ["-h", "--help"]},
    )
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(app)
    return app


def main() -> None:
    create_app()(prog_name="dflash")
