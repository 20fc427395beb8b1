"""Opening a build's sessions: which session class a backend and its compile settings call for.

This is where `compile.backend` picks the backend (as the build stages do); what decoding then needs to know
of a session it reads from the session's traits (backends/base.py SessionTraits), never the backend's name.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from dflash_cli.errors import BackendError


def open_session(backend: str, compile_dir: Path, graph: str, recipe: Any, tables=None, spinning: bool | None = None):
    info = json.loads((compile_dir / "export.json").read_text())
    facts_path = compile_dir / "compile.json"
    facts = json.loads(facts_path.read_text()) if facts_path.is_file() else {}
    opener = _OPENERS.get(backend)
    if opener is None:
        raise BackendError(f"unknown backend {backend!r}", hint="compile.backend is ort or qaic")
    return opener(compile_dir, graph, recipe, info, facts, tables, spinning)


def _open_qaic(compile_dir: Path, graph: str, recipe: Any, info: dict, facts: dict, tables, spinning):
    from dflash_cli.qaic.command import QaicCompileOptions
    from dflash_cli.qaic.compile import cores_per_device
    from dflash_cli.qaic.runtime import open_qaic_session
    from dflash_cli.qaic.sdk import find_sdk

    options = QaicCompileOptions.from_mapping(recipe.compile.qaic.model_dump())
    hw = facts.get("hw_version") or recipe.compile.qaic.aic_hw_version or "ai100"
    vision = "vision" in info["graphs"]  # compiled beside the pair: the cores were split three ways
    options.check_fit(cores_per_device(hw, find_sdk()), vision)  # the programs run at once: they must fit
    cores, devices = options.placement(vision)[graph]
    return open_qaic_session(compile_dir, graph, list(devices), num_cores=cores)


def _open_ort(compile_dir: Path, graph: str, recipe: Any, info: dict, facts: dict, tables, spinning: bool | None):
    from dflash_cli.backends.ort import OrtSession, OrtSettings, resolve_provider

    o = recipe.compile.ort
    path = compile_dir / info["graphs"][graph]["onnx"]
    spin = o.allow_spinning if spinning is None else spinning
    settings = OrtSettings(o.intra_op_threads, o.graph_optimization, o.provider, spin)
    on_cpu = resolve_provider(settings.provider) == "CPUExecutionProvider"
    prefix = info["graphs"].get(f"{graph}_prefix")
    # The build found the prefix-cache target's rows depending on the call's length (ortcompile/checks.py):
    # greedy DFlash would not always equal greedy plain on it, so both graphs run in their static form.
    lossless = facts.get("prefix_target_lossless", True)
    if prefix and on_cpu and o.prefix_cache and lossless:
        from dflash_cli.backends.ort_prefix import open_prefix_session

        path = compile_dir / prefix["onnx"]
        shared = tables.for_graph(path) if tables is not None else None
        sess = open_prefix_session(path, graph, info["ctx_len"], settings, shared)
        # The build found one-token calls already computing a block's numbers: no second row to pay for.
        sess.pad_single_rows = facts.get("prefix_one_token_calls") != "one row"
        return sess
    shared = tables.for_graph(path) if tables is not None and on_cpu else None
    sess = OrtSession(path, graph, settings, shared)
    return sess


_OPENERS = {"qaic": _open_qaic, "ort": _open_ort}  # compile.backend -> how its sessions open


def weight_bytes(compile_dir: Path, onnx_name: str, backend: str) -> int:
    """Bytes of weights one call reads (for the bandwidth estimate)."""
    if backend == "ort":
        from dflash_cli.ortcompile.checks import graph_weight_bytes

        return graph_weight_bytes(compile_dir / onnx_name)
    total = 0
    for f in compile_dir.glob(onnx_name + "*"):
        total += f.stat().st_size
    return total
