"""The `dflash` Typer app: each command module in COMMAND_MODULES registers its commands.

Command modules import only typer, rich and light dflash modules at import time; torch, onnx and
transformers are imported inside the commands so `dflash --help` stays instant.
"""

from __future__ import annotations

import importlib
import os

import typer

# Append a module (exposing `register(app: typer.Typer) -> None`) to add commands.
COMMAND_MODULES: tuple[str, ...] = (
    "dflash_cli.cli.build",
    "dflash_cli.cli.stages_cmd",
    "dflash_cli.cli.recipes",
    "dflash_cli.cli.cache_cmd",
    "dflash_cli.cli.doctor",
    "dflash_cli.cli.compile_cmd",
    "dflash_cli.cli.run",
    "dflash_cli.cli.serve",
    "dflash_cli.cli.bench",
    "dflash_cli.cli.check",
)


def create_app() -> typer.Typer:
    app = typer.Typer(
        name="dflash",
        help="Compile and run DFlash speculative decoding: convert -> inject -> export -> compile -> run / bench.",
        epilog="Start with: dflash doctor, then dflash build --recipe demo. DFLASH_DEBUG=1 shows tracebacks.",
        no_args_is_help=True,
        add_completion=True,  # `dflash --install-completion` for bash/zsh/fish
        pretty_exceptions_enable=False,
        context_settings={"help_option_names": ["-h", "--help"]},
    )
    app.callback()(_root)
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(app)
    return app


def _show_version(value: bool) -> None:
    if value:
        import dflash_cli

        typer.echo(f"dflash {dflash_cli.__version__}")
        raise typer.Exit()


def _root(
    version: bool = typer.Option(
        False, "--version", "-V", callback=_show_version, is_eager=True, help="Print the version and exit."
    ),
) -> None:
    """Compile and run DFlash speculative decoding: convert -> inject -> export -> compile -> run / bench."""


def _quiet_third_party() -> None:
    """Keep library chatter (load reports, shard progress bars) out of our output unless debugging.

    Set as environment defaults before transformers/huggingface_hub are imported; a user's own
    settings win.
    """
    if os.environ.get("DFLASH_DEBUG", "") in ("", "0", "false", "no"):
        os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
        os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
        os.environ.setdefault("TORCH_LOGS", "-all")


def main() -> None:
    _quiet_third_party()
    create_app()(prog_name="dflash")
