"""`dflash doctor`: what this machine has (tool versions, ORT providers, QAIC SDK, cache)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import typer

from dflash_cli.cli.common import (
    CacheDirOpt,
    JsonOpt,
    examples,
    handle_errors,
    human_size,
    make_table,
    print_json,
    print_table,
)


def register(app: typer.Typer) -> None:
    app.command("doctor", epilog=examples("dflash doctor", "dflash doctor --json"))(doctor_command)


@handle_errors
def doctor_command(cache_dir: CacheDirOpt = None, json_: JsonOpt = False) -> None:
    """Report tool versions, ONNX Runtime providers, the QAIC SDK and the cache location."""
    report = collect(cache_dir)
    if json_:
        print_json(report)
        return
    table = make_table("check", "value")
    table.add_row("python", report["python"])
    for tool, version in report["versions"].items():
        table.add_row(tool, version)
    table.add_row("ort providers", ", ".join(report["ort_providers"]) or "none")
    qaic = report["qaic"]
    if qaic["present"]:
        table.add_row("qaic sdk", f"{qaic['root']} ({qaic['version'] or 'version unknown'})")
        table.add_row("qaic-compile", qaic["qaic_compile"] or "not found")
        table.add_row("qaic-exec", qaic["qaic_exec"] or "not found")
    else:
        table.add_row("qaic sdk", f"not installed ({qaic['root']} missing); the qaic backend is unavailable")
    cache = report["cache"]
    state = "writable" if cache["writable"] else "NOT writable (use --cache-dir or DFLASH_HOME)"
    table.add_row("cache", f"{cache['root']} ({state})")
    table.add_row("cache size", f"{human_size(cache['size'])} in {cache['artifacts']} artifact(s)")
    print_table(table)


def collect(cache_dir: Path | None) -> dict[str, Any]:
    from dflash_cli.cache.store import Cache
    from dflash_cli.host.versions import ort_providers, python_version, qaic_sdk_info, tool_versions

    cache = Cache(cache_dir)
    return {
        "python": python_version(),
        "versions": tool_versions(),
        "ort_providers": ort_providers(),
        "qaic": qaic_sdk_info(),
        "cache": {
            "root": str(cache.root),
            "writable": _writable(cache.root),
            "size": cache.size(),
            "artifacts": sum(1 for e in cache.entries() if e.problem is None),
        },
    }


def _writable(path: Path) -> bool:
    # The cache is created on first build: check the nearest directory that exists. A real write, not
    # os.access: root passes every permission-bit check, yet read-only filesystems still refuse it.
    import tempfile

    while not path.exists() and path != path.parent:
        path = path.parent
    try:
        with tempfile.NamedTemporaryFile(dir=path, prefix=".dflash-probe-"):
            return True
    except OSError:
        return False
