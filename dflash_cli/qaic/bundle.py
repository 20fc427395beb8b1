"""A self-contained compile bundle for a host that has the QAIC SDK (this one need not).

  <dest>/export.json            copied from the export artifact
  <dest>/target.onnx, draft.onnx (+ their external-data files)
  <dest>/target/, <dest>/draft/ specializations.json, custom_io.yaml, [mdp_partition.json]
  <dest>/compile.sh             the exact compiler commands, paths relative to <dest>
  <dest>/README.txt

After `bash compile.sh`, <dest> has the same layout as a compile artifact
(`<graph>/qpc/programqpc.bin`), so runtime.open_qaic_session(<dest>, graph) can open it.
"""

from __future__ import annotations

import shlex
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

from dflash_cli.errors import BackendError
from dflash_cli.qaic.command import CompilerTool, QaicCompileOptions, compiler_command
from dflash_cli.qaic.sdk import CORES_PER_CARD, DEFAULT_ROOT, HwVersion
from dflash_cli.qaic.specs import (
    EXPORT_FILE,
    PROGRAM_FILE,
    QPC_DIR,
    has_retained_state,
    onnx_has_local_functions,
    program_graph,
    programs_of,
    read_export_json,
    write_graph_inputs,
)

if TYPE_CHECKING:
    import onnx

SCRIPT_FILE = "compile.sh"
README_FILE = "README.txt"
LOG_FILE = "compile.log"
# The script word for the compiler: a variable so a host can point it elsewhere.
_COMPILER_WORD = '"$QAIC_COMPILE"'
_EXTRA_WORD = '${EXTRA[@]+"${EXTRA[@]}"}'  # empty-array safe under `set -u` on bash < 4.4


def emit_bundle(
    export_dir: Path,
    dest_dir: Path,
    options: QaicCompileOptions,
    hw_version: HwVersion | None = None,
) -> Path:
    """Write the bundle into `dest_dir` (created; must be empty if it exists); returns it.

    `hw_version` None means the recipe's `aic_hw_version`, else ai100: the bundle is built
    for another host, so this host's cards (if any) say nothing about it.
    """
    export_dir, dest_dir = Path(export_dir), Path(dest_dir)
    if dest_dir.exists() and any(dest_dir.iterdir()):
        raise BackendError(f"{dest_dir} is not empty", hint="choose a new or empty directory for --emit-script")
    info = read_export_json(export_dir)
    hw = hw_version or options.aic_hw_version or "ai100"
    vision = "vision" in programs_of(info)
    options.check_fit(CORES_PER_CARD.get(hw), vision)
    dest_dir.mkdir(parents=True, exist_ok=True)
    shutil.copy2(export_dir / EXPORT_FILE, dest_dir / EXPORT_FILE)

    commands: dict[str, list[str]] = {}
    for graph in programs_of(info):
        graph_info = program_graph(info, graph)
        onnx_name = graph_info["onnx"]
        graph_options = options.for_graph(graph, vision)
        copy_onnx_with_data(export_dir / onnx_name, dest_dir / onnx_name)
        write_graph_inputs(
            graph_info,
            dest_dir / onnx_name,
            dest_dir / graph,
            ctx_len=info["ctx_len"],
            kv_precision=graph_options.kv_precision,
            num_devices=graph_options.num_devices,
            num_cores=graph_options.num_cores,
            fmt=graph_options.specialization_format,
        )
        # compile_only is decided in the script from the compiler's name, not here.
        commands[graph] = compiler_command(
            CompilerTool(_COMPILER_WORD),
            onnx_name,
            graph,
            graph_options,
            hw_version=hw,
            has_local_functions=onnx_has_local_functions(dest_dir / onnx_name),
            retained_state=has_retained_state(graph_info),
        )
    script = dest_dir / SCRIPT_FILE
    script.write_text(render_script(commands), encoding="utf-8")
    script.chmod(0o755)
    (dest_dir / README_FILE).write_text(render_readme(hw, options, vision), encoding="utf-8")
    return dest_dir


def external_data_files(model: onnx.ModelProto) -> set[str]:
    """Relative locations of every external-data file a model's tensors point to."""
    import onnx

    found: set[str] = set()

    def visit_tensor(t: onnx.TensorProto) -> None:
        if t.data_location == onnx.TensorProto.EXTERNAL:
            found.update(e.value for e in t.external_data if e.key == "location")

    def visit_graph(g: onnx.GraphProto) -> None:
        for t in g.initializer:
            visit_tensor(t)
        for node in g.node:
            for attr in node.attribute:
                if attr.HasField("t"):
                    visit_tensor(attr.t)
                for t in attr.tensors:
                    visit_tensor(t)
                if attr.HasField("g"):
                    visit_graph(attr.g)
                for sub in attr.graphs:
                    visit_graph(sub)

    visit_graph(model.graph)
    return found


def copy_onnx_with_data(src: Path, dst: Path) -> None:
    """Copy an ONNX file and the external-data files beside it (their relative paths kept)."""
    import onnx

    model = onnx.load(str(src), load_external_data=False)
    shutil.copy2(src, dst)
    for location in sorted(external_data_files(model)):
        target = dst.parent / location
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src.parent / location, target)


def _shell_line(cmd: list[str]) -> str:
    # The first word is the script variable, already quoted for the shell; the rest are literal.
    words = [cmd[0], *(shlex.quote(w) for w in cmd[1:]), _EXTRA_WORD]
    return " \\\n  ".join(words)


def render_script(commands: dict[str, list[str]]) -> str:
    """compile.sh: one compiler call per graph, each log kept, success checked by file."""
    lines = [
        "#!/usr/bin/env bash",
        "# Compile the DFlash target and draft graphs for Qualcomm Cloud AI 100 (generated by dflash).",
        "# Run on a host with the Cloud AI 100 Apps SDK:",
        "#   bash compile.sh",
        "#   QAIC_COMPILE=/opt/qti-aic/exec/qaic-exec bash compile.sh   # SDKs before 1.21",
        "set -euo pipefail",
        'cd "$(dirname "${BASH_SOURCE[0]}")"',
        f"QAIC_COMPILE=${{QAIC_COMPILE:-{DEFAULT_ROOT}/exec/qaic-compile}}",
        "# qaic-exec also runs programs; -compile-only makes it stop after compiling.",
        "EXTRA=()",
        'if [[ "$(basename "$QAIC_COMPILE")" == qaic-exec ]]; then EXTRA=(-compile-only); fi',
        "",
    ]
    for graph, cmd in commands.items():
        program = f"{graph}/{QPC_DIR}/{PROGRAM_FILE}"
        lines += [
            f"echo 'compiling the {graph} graph (log: {graph}/{LOG_FILE})'",
            f"rm -rf {graph}/{QPC_DIR}",
            f"{_shell_line(cmd)} \\\n  2>&1 | tee {graph}/{LOG_FILE}",
            f"test -f {program} || {{ echo 'error: no {program}; see {graph}/{LOG_FILE}' >&2; exit 1; }}",
            "",
        ]
    lines.append(f"echo 'done: {' and '.join(f'{g}/{QPC_DIR}' for g in commands)}'")
    return "\n".join(lines) + "\n"


def render_readme(hw_version: str, options: QaicCompileOptions, vision: bool = False) -> str:
    return f"""DFlash compile bundle for Qualcomm Cloud AI 100
================================================

This directory holds the exported DFlash target and draft ONNX graphs and everything the QAIC
compiler needs besides them. It was written by `dflash` on a host without the QAIC SDK;
nothing in it has been compiled yet.

On a host with the Cloud AI 100 Apps SDK (/opt/qti-aic):

    bash compile.sh

Older SDKs without exec/qaic-compile:

    QAIC_COMPILE=/opt/qti-aic/exec/qaic-exec bash compile.sh

Settings baked into the commands: hardware {hw_version}, {_placement_text(options, vision)},
KV cache {options.kv_precision}, mxfp6 MatMul {options.mxfp6_matmul}.
To change them, emit the bundle again with other recipe settings.

Success is <graph>/qpc/programqpc.bin for each graph ({", ".join(_graphs(vision))}); each graph's
compiler output is kept in <graph>/compile.log.{_vision_text(vision)} A quick health check on a card:

    /opt/qti-aic/exec/qaic-runner -t target/qpc -n 10 -d 0

After compiling, this directory has the layout of a dflash compile artifact
(<graph>/qpc/programqpc.bin).
"""


def _graphs(vision: bool) -> tuple[str, ...]:
    return ("target", "draft", "vision") if vision else ("target", "draft")


def _vision_text(vision: bool) -> str:
    if not vision:
        return ""
    return """ The vision program is the target's vision tower, one image
per call, specialized for a fixed number of image tokens (specializations.json); all three
programs are loaded on the card at once. dflash's own runtime runs the tower on the host CPU
(ONNX Runtime) and does not load the vision program yet."""


def _placement_text(options: QaicCompileOptions, vision: bool = False) -> str:
    placement = options.placement(vision).items()
    return ", ".join(f"{graph} {cores} cores on {len(devices)} device(s)" for graph, (cores, devices) in placement)
