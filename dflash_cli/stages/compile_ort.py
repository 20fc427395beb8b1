"""The ONNX Runtime compile, step by step: link the export, quantise, fuse, check, write compile.json.

The export's graphs and data files are hard-linked, never copied; quantised weights go to `.q.data`
files beside the graphs (ortcompile/quantize.py); the graphs are rewritten for ONNX Runtime's fused
kernels (ortcompile/fuse.py, `compile.ort.fuse`); then the checks of stages/compile_checks.py.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from dflash_cli.errors import DFlashError
from dflash_cli.stages.base import StageContext


def compile_ort(ctx: StageContext) -> dict[str, Any]:
    from dflash_cli.stages.compile_checks import check_graphs

    src, out = ctx.inputs["export"], ctx.out_dir
    info = json.loads((src / "export.json").read_text())
    ort_cfg = ctx.recipe.compile.ort
    _link_export(src, out, info, ort_cfg.precision)
    facts: dict[str, Any] = {"backend": "ort", "precision": ort_cfg.precision}
    if ort_cfg.precision != "fp32":
        _quantise_graphs(ctx, src, out, info, facts)
    unfused = _fuse_graphs(ctx, out, info, facts)
    check_graphs(ctx, src, out, info, unfused, facts)
    for keep in unfused.values():
        keep.unlink()
    shutil.copy2(src / "export.json", out / "export.json")
    shutil.copy2(src / "pair.json", out / "pair.json")
    (out / "compile.json").write_text(json.dumps(facts, indent=2) + "\n")
    return facts


def _link_export(src: Path, out: Path, info: dict, precision: str) -> None:
    """fp32 uses the export's graphs and data as they are; int8/int4/w8a8 keep their unquantised weights
    (embedding, norms) in the export's data files and write graphs of their own."""
    from dflash_cli.checkpoints.weights import link_or_copy

    for path in sorted(src.iterdir()):
        if path.suffix in (".onnx", ".data") and not (precision != "fp32" and path.suffix == ".onnx"):
            link_or_copy(path, out / path.name)
    if info.get("lean") and precision == "fp32":  # the stage keys rule this out: a cache edited by hand
        raise DFlashError(
            "this export leaves out the checkpoint's weights (an int8/int4 build's); an fp32 compile needs them",
            hint="rebuild the export: `dflash build --rebuild export`",
        )


def _quantise_graphs(ctx: StageContext, src: Path, out: Path, info: dict, facts: dict) -> None:
    from dflash_cli.exporting.weight_sources import SourceReader
    from dflash_cli.ortcompile.quantize import quantize_graph

    ort_cfg = ctx.recipe.compile.ort
    precision = ort_cfg.precision
    bits = 4 if precision == "int4" else 8  # w8a8: its tables and experts are int8 blocks
    facts["block_size"] = ort_cfg.block_size
    level = facts["accuracy_level"] = ort_cfg.accuracy_level
    hybrid = any(n.startswith("past_delta") for n in info["graphs"]["target"]["inputs"])
    if hybrid and not ort_cfg.prefix_cache and (level or precision == "w8a8"):
        ctx.progress(
            "warning: without compile.ort.prefix_cache a hybrid target runs its static graphs, whose delta rule is "
            "in block form (it rounds differently by call length); on int8 activations greedy DFlash may leave "
            "greedy plain decoding: keep prefix_cache (the default) or set accuracy_level 0"
        )
    form = (
        "w8a8 (int8 weights, each activation row quantised on its own)"
        if precision == "w8a8"
        else f"int{bits} (weight-only, block {ort_cfg.block_size})"
    )
    done: dict = {}  # quantised once, referenced by both graphs (the draft's lm_head is the target's)
    for gname, g in info["graphs"].items():
        ctx.progress(f"quantising {gname} MatMul weights to {form}")
        source = SourceReader.for_graph(src, g["onnx"])
        result = quantize_graph(
            src / g["onnx"],
            out / g["onnx"],
            bits=bits,
            block_size=ort_cfg.block_size,
            accuracy_level=level,
            progress=ctx.progress,
            done=done,
            fuse_siblings=ort_cfg.fuse,  # q/k/v and gate/up stacked into one projection each
            source=source,
            rows=precision == "w8a8",
        )
        facts[f"{gname}_weights_read_from_checkpoint"] = source.read_count if source is not None else 0
        facts[f"{gname}_quantized_matmuls"] = result.quantized
        facts[f"{gname}_stacked_matmuls"] = result.stacked
        if result.experts:
            facts[f"{gname}_quantized_moe_layers"] = result.experts
        if result.quantized == 0:
            raise DFlashError(
                f"{gname}.onnx has no MatMul with a constant weight to quantise",
                hint="rebuild the export stage: `dflash build --rebuild export`",
            )


def _fuse_graphs(ctx: StageContext, out: Path, info: dict, facts: dict) -> dict[str, Path]:
    """Rewrite each graph for ONNX Runtime's fused kernels; returns graph -> its unfused .onnx (beside its
    data), which the checks compare the fused one against."""
    from dflash_cli.ortcompile.fuse import fuse_graph
    from dflash_cli.stages.compile_checks import note_unfused_attention

    ort_cfg = ctx.recipe.compile.ort
    unfused: dict[str, Path] = {}
    if "target_prefix" in info["graphs"] and not (ort_cfg.fuse and ort_cfg.fuse_attention):
        off = "compile.ort.fuse" if not ort_cfg.fuse else "compile.ort.fuse_attention"
        facts["prefix_attention"] = f"unfused ({off} is false)"
    if not ort_cfg.fuse:
        return unfused
    for gname, g in info["graphs"].items():
        if gname == "vision":  # its LayerNorms and GELUs are ONNX Runtime's own fusions already
            continue
        path = out / g["onnx"]
        fused = path.with_name(path.stem + ".fused.onnx")
        # Only the prefix-cache target: its attention is causal (the draft's block attention is not) and
        # the host session of a prefix graph can own in-place buffers (static graphs keep their convention).
        attention = gname == "target_prefix" and ort_cfg.fuse_attention
        result = fuse_graph(path, fused, attention=attention, windows=g.get("attention_windows"))
        facts[f"{gname}_fused"] = {
            "rmsnorm": result.norms,
            "v_guard": result.v_guards,
            "silu": result.silu,
            "attention": result.attention,
            "row_pads_merged": result.merged_pads,
            "skipped": result.skipped,
        }
        ctx.progress(
            f"{gname}: {result.norms} RMSNorms fused, {result.v_guards} V guards dropped, {result.silu} SiLUs fused"
            + (f", {result.attention} attention layers -> GroupQueryAttention" if result.attention else "")
        )
        if gname == "target_prefix" and ort_cfg.fuse_attention:
            if result.attention:
                facts["prefix_attention"] = f"GroupQueryAttention ({result.attention} layers)"
            else:  # what ONNX Runtime's kernel would refuse (ortcompile/gqa.py) stays as exported
                why = "; ".join(w.removeprefix("attention: ") for w in result.skipped if w.startswith("attention:"))
                note_unfused_attention(facts, why or "not rewritten", ctx.progress)
        keep = path.with_name(path.stem + ".unfused.onnx")
        path.rename(keep)  # a hard link to the export for fp32: renaming never touches the export's file
        fused.rename(path)
        unfused[gname] = keep
    return unfused
