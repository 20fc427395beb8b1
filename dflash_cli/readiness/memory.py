"""Whether the fp16 emulation checks fit in memory, asked before they open anything.

Both checks hold the exported graphs twice besides the engine: as exported (the fp32 reference) and
emulated, where every weight is read through a Cast to float32 that ONNX Runtime folds into a
float32 copy. On a 4B pair exported in fp16 that is ~24 GB: the kernel's OOM killer would end the
command with no message, so the checks are skipped with a line saying why instead.
"""

from __future__ import annotations

import json
from pathlib import Path

from dflash_cli.host.memory import available_bytes

HEADROOM = 0.9  # of MemAvailable: sessions also allocate arenas and activations


def emulation_bytes(export_dir: Path) -> int:
    """Memory the reference and emulated sessions of target and draft need together (weights only)."""
    from dflash_cli.ortcompile.checks import graph_weight_bytes

    info = json.loads((Path(export_dir) / "export.json").read_text())
    widen = 2 if info.get("dtype") == "fp16" else 1  # the emulation's float32 copy of each weight
    return sum(
        graph_weight_bytes(Path(export_dir) / info["graphs"][g]["onnx"]) * (1 + widen) for g in ("target", "draft")
    )


def emulation_does_not_fit(export_dir: Path) -> str | None:
    """None when the checks fit, else why not (one line)."""
    need, free = emulation_bytes(export_dir), available_bytes()
    if free is None or need <= HEADROOM * free:
        return None
    return (
        f"the fp32 reference and fp16 emulation of both graphs need ~{need / 2**30:.1f} GiB, "
        f"{free / 2**30:.1f} GiB is available"
    )
