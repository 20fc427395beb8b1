"""Compile the exported target and draft graphs with qaic-compile.

Layout written into `out_dir` (the compile stage's temporary artifact directory):
  target/specializations.json, target/custom_io.yaml, [target/mdp_partition.json]
  target/compile.log          the command line, then the compiler's stdout+stderr
  target/qpc/programqpc.bin   the program (success is decided by this file existing)
  draft/...                   the same for the draft graph
"""

from __future__ import annotations

import logging
import re
import shlex
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from dflash_cli.errors import BackendError
from dflash_cli.qaic.command import CompilerTool, QaicCompileOptions, compiler_command
from dflash_cli.qaic.sdk import CORES_PER_CARD, HwVersion, QaicSdk, detect_hw_version, query_devices, require_sdk
from dflash_cli.qaic.specs import (
    PROGRAM_FILE,
    QPC_DIR,
    SPECIALIZATIONS_FILE,
    has_retained_state,
    onnx_has_local_functions,
    program_graph,
    programs_of,
    read_export_json,
    write_graph_inputs,
)

log = logging.getLogger(__name__)

LOG_FILE = "compile.log"
TAIL_LINES = 15
_UNSUPPORTED_RE = re.compile(r"unsupported|not supported", re.IGNORECASE)


def resolve_hw_version(options: QaicCompileOptions, sdk: QaicSdk | None) -> HwVersion:
    """The recipe's choice, else the card on this host, else ai100 (the common card)."""
    if options.aic_hw_version is not None:
        return options.aic_hw_version
    detected = detect_hw_version(sdk) if sdk is not None else None
    return detected or "ai100"


def cores_per_device(hw_version: str, sdk: QaicSdk | None) -> dict[int, int] | int | None:
    """Each visible card's cores (qaic-util), else the hardware version's, else None (unknown: no check)."""
    devices = query_devices(sdk) if sdk is not None and sdk.util else []
    known = {d.qid: d.nsp_total for d in devices if d.nsp_total}
    return known or CORES_PER_CARD.get(hw_version)


def key_fields(options: QaicCompileOptions, sdk: QaicSdk | None) -> dict[str, Any]:
    """Cache-key inputs of a QAIC compile: options, resolved hardware and the SDK version.

    The SDK version is in the key because a new compiler produces a different program from
    the same ONNX (mlc-llm's cache missed exactly this).
    """
    return {
        "options": options.key_fields(),
        "hw_version": resolve_hw_version(options, sdk),
        "sdk_version": sdk.version if sdk else None,
        "compiler_kind": sdk.compiler_kind if sdk else None,
    }


def compile_graphs(
    export_dir: Path,
    out_dir: Path,
    options: QaicCompileOptions,
    progress: Callable[[str], None] | None = None,
    *,
    sdk: QaicSdk | None = None,
) -> dict[str, Any]:
    """Compile target then draft into `out_dir`; return facts for the stage manifest.

    Raises BackendError when the SDK is missing or a compile fails; the error quotes the
    compiler's unsupported-op lines and the end of its log.
    """
    export_dir, out_dir = Path(export_dir), Path(out_dir)
    sdk = sdk or require_sdk()
    progress = progress or (lambda _msg: None)
    info = read_export_json(export_dir)
    hw_version = resolve_hw_version(options, sdk)
    tool = CompilerTool.from_sdk(sdk)
    facts: dict[str, Any] = {
        "sdk": {
            "root": str(sdk.root),
            "compiler": str(sdk.compiler),
            "compiler_kind": sdk.compiler_kind,
            "apps_version": sdk.apps_version,
            "platform_version": sdk.platform_version,
        },
        "hw_version": hw_version,
        "options": options.key_fields(),
        "graphs": {},
    }
    vision = "vision" in programs_of(info)
    options.check_fit(cores_per_device(hw_version, sdk), vision)  # before minutes of compiling, not at first run
    for graph in programs_of(info):
        graph_info = program_graph(info, graph)
        onnx_path = export_dir / graph_info["onnx"]
        work = out_dir / graph
        graph_options = options.for_graph(graph, vision)
        write_graph_inputs(
            graph_info,
            onnx_path,
            work,
            ctx_len=info["ctx_len"],
            kv_precision=graph_options.kv_precision,
            num_devices=graph_options.num_devices,
            num_cores=graph_options.num_cores,
            fmt=graph_options.specialization_format,
        )
        cmd = compiler_command(
            tool,
            onnx_path,
            work,
            graph_options,
            hw_version=hw_version,
            has_local_functions=onnx_has_local_functions(onnx_path),
            retained_state=has_retained_state(graph_info),
        )
        progress(f"compiling {graph} graph with {sdk.compiler_kind} ({hw_version}, {graph_options.num_cores} cores)")
        started = time.monotonic()
        returncode = run_compiler(cmd, work / LOG_FILE)
        check_compiled(graph, work, returncode)
        facts["graphs"][graph] = {
            "onnx": str(onnx_path),
            "command": cmd,
            "qpc_dir": f"{graph}/{QPC_DIR}",
            "specializations": f"{graph}/{SPECIALIZATIONS_FILE}",
            "log": f"{graph}/{LOG_FILE}",
            "seconds": round(time.monotonic() - started, 3),
        }
    return facts


def run_compiler(cmd: list[str], log_path: Path) -> int:
    """Run `cmd`, writing its command line then its merged stdout/stderr to `log_path`.

    Output is streamed line by line (a large compile prints for a long time) and mirrored to
    this module's debug log, never printed: library code leaves the console to the CLI.
    """
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with log_path.open("w", encoding="utf-8") as sink:
        sink.write(f"$ {shlex.join(cmd)}\n")
        sink.flush()
        try:
            proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace")
        except OSError as exc:
            raise BackendError(
                f"cannot run the QAIC compiler {cmd[0]}: {exc}",
                hint="check the SDK installation (exec/ must be executable)",
            ) from exc
        assert proc.stdout is not None
        for line in proc.stdout:
            sink.write(line)
            log.debug("qaic-compile: %s", line.rstrip())
        return proc.wait()


def check_compiled(graph: str, work: Path, returncode: int) -> Path:
    """programqpc.bin is the only proof of success; otherwise explain from the log."""
    program = work / QPC_DIR / PROGRAM_FILE
    if returncode == 0 and program.is_file():
        return program
    log_path = work / LOG_FILE
    unsupported, tail = summarize_log(log_path)
    reason = f"exited with code {returncode}" if returncode else f"exited 0 but wrote no {QPC_DIR}/{PROGRAM_FILE}"
    parts = [f"qaic-compile failed on the {graph} graph: {reason}"]
    if unsupported:
        parts.append("unsupported-op lines:\n  " + "\n  ".join(unsupported))
    if tail:
        parts.append(f"last lines of {log_path}:\n  " + "\n  ".join(tail))
    raise BackendError(
        "\n".join(parts),
        hint="check the graph with the QAIC readiness report (static shapes, supported ops)",
    )


def summarize_log(log_path: Path, tail: int = TAIL_LINES) -> tuple[list[str], list[str]]:
    """(lines naming unsupported ops, the last `tail` lines) of a compile log."""
    try:
        lines = [ln.rstrip() for ln in log_path.read_text(encoding="utf-8", errors="replace").splitlines()]
    except OSError:
        return [], []
    body = lines[1:]  # the first line is our own echo of the command
    unsupported = [ln.strip() for ln in body if _UNSUPPORTED_RE.search(ln)][:10]
    return unsupported, [ln for ln in body if ln.strip()][-tail:]
