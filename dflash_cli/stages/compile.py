"""compile stage: exported graphs -> runnable programs for the recipe's backend.

ONNX Runtime (default): the graphs as-is (fp32) or with MatMul weights dynamically quantised to
int8, plus the session settings; a smoke call proves each graph loads and runs. QAIC: the
Cloud AI 100 compiler (dflash_cli.qaic).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from dflash_cli.stages.base import StageContext


class CompileStage:
    name = "compile"
    version = 1
    upstream = ("export",)

    def key_fields(self, recipe: Any) -> dict[str, Any]:
        c = recipe.compile
        if c.backend == "qaic":
            from dflash_cli.qaic.compile import key_fields as qaic_key_fields
            from dflash_cli.qaic.sdk import find_sdk

            return {"backend": "qaic", **qaic_key_fields(_qaic_options(recipe), find_sdk())}
        return {"backend": "ort", "precision": c.ort.precision}

    def run(self, ctx: StageContext) -> dict[str, Any]:
        if ctx.recipe.compile.backend == "qaic":
            from dflash_cli.qaic.compile import compile_graphs

            src = ctx.inputs["export"]
            facts = compile_graphs(src, ctx.out_dir, _qaic_options(ctx.recipe), ctx.progress)
            shutil.copy2(src / "export.json", ctx.out_dir / "export.json")
            return facts
        return _compile_ort(ctx)


def _qaic_options(recipe: Any):
    from dflash_cli.qaic.command import QaicCompileOptions

    return QaicCompileOptions.from_mapping(recipe.compile.qaic.model_dump())


def _compile_ort(ctx: StageContext) -> dict[str, Any]:
    src, out = ctx.inputs["export"], ctx.out_dir
    info = json.loads((src / "export.json").read_text())
    precision = ctx.recipe.compile.ort.precision
    for gname, g in info["graphs"].items():
        onnx_in = src / g["onnx"]
        if precision == "int8":
            ctx.progress(f"quantising {gname} MatMul weights to int8")
            _quantize_int8(onnx_in, out / g["onnx"])
        else:
            shutil.copy2(onnx_in, out / g["onnx"])
            data = onnx_in.with_name(onnx_in.name + ".data")
            if data.exists():
                shutil.copy2(data, out / data.name)
        ctx.progress(f"loading {gname} in ONNX Runtime")
        _smoke(out / g["onnx"], gname, g, info)
    shutil.copy2(src / "export.json", out / "export.json")
    (out / "compile.json").write_text(json.dumps({"backend": "ort", "precision": precision}, indent=2) + "\n")
    return {"backend": "ort", "precision": precision}


def _quantize_int8(src: Path, dst: Path) -> None:
    from onnxruntime.quantization import QuantType, quantize_dynamic

    quantize_dynamic(
        str(src),
        str(dst),
        op_types_to_quantize=["MatMul"],
        weight_type=QuantType.QInt8,
        use_external_data_format=src.with_name(src.name + ".data").exists(),
    )


def _smoke(path: Path, gname: str, g: dict, info: dict) -> None:
    """One call with zero inputs: proves the graph loads and runs under the session we ship."""
    import numpy as np

    from dflash_cli.backends.ort import OrtSession

    sess = OrtSession(path, gname)
    B, P = info["block_size"], info["prefill_seq_len"]
    feeds = {"input_ids": np.zeros((1, B), np.int64), "position_ids": np.arange(P, P + B, dtype=np.int64)[None]}
    if gname == "draft":
        H = sess._sess.get_inputs()[2].shape[-1]
        feeds.update(
            context_features=np.zeros((1, B, H), np.float32), context_position_ids=np.arange(B, dtype=np.int64)[None]
        )
    sess.run(feeds)


STAGE = CompileStage()
