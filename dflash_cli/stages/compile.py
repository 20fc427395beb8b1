"""compile stage: exported graphs -> runnable programs for the recipe's backend.

ONNX Runtime (default; stages/compile_ort.py): the exported graphs' weights as they are (fp32/fp16,
hard-linked, no copy) or with MatMul weights quantised (int8/int4 MatMulNBits, or w8a8's integer
products; dflash_cli.ortcompile); the graphs rewritten for ONNX Runtime's fused kernels (ortcompile.fuse,
`compile.ort.fuse`); then the checks of stages/compile_checks.py, when the graphs fit the build's memory
budget.
QAIC: the Cloud AI 100 compiler (dflash_cli.qaic).
"""

from __future__ import annotations

import shutil
from typing import Any

from dflash_cli.stages.base import StageContext


class CompileStage:
    name = "compile"
    # 5: stacked q/k/v, gate/up; 6: prefix-cache graphs share stacks; 7: call-length check; 8: GQA pads one-row calls;
    # 9: the call-length check covers the hybrid's verifies past the block; 10: SiLU as QuickGelu, q/k/v
    # padded once before their stacked Split; 11: a hybrid target's call-length check asks equal tokens only
    # 13: the embedding to GatherBlockQuantized; 14: per-sequence cache lengths (batched calls); 15: batch
    # invariance checked also where the other checks are too big for memory
    version = 15
    upstream = ("export",)
    tools: tuple[str, ...] = ("onnx", "onnxruntime")  # the QAIC SDK version is in key_fields

    def key_fields(self, recipe: Any) -> dict[str, Any]:
        c = recipe.compile
        if c.backend == "qaic":
            from dflash_cli.families import require_qaic_support
            from dflash_cli.qaic.compile import key_fields as qaic_key_fields
            from dflash_cli.qaic.sdk import find_sdk

            require_qaic_support(recipe.family)  # refused while the build is planned
            return {"backend": "qaic", **qaic_key_fields(_qaic_options(recipe), find_sdk())}
        fields = {"backend": "ort", "precision": c.ort.precision, "fuse": c.ort.fuse}
        if c.ort.fuse:
            fields["fuse_attention"] = c.ort.fuse_attention
        if c.ort.precision != "fp32":
            fields["block_size"] = c.ort.block_size
            fields["accuracy_level"] = c.ort.accuracy_level
        return fields

    def run(self, ctx: StageContext) -> dict[str, Any]:
        if ctx.recipe.compile.backend == "qaic":
            from dflash_cli.qaic.compile import compile_graphs

            src = ctx.inputs["export"]
            facts = compile_graphs(src, ctx.out_dir, _qaic_options(ctx.recipe), ctx.progress)
            shutil.copy2(src / "export.json", ctx.out_dir / "export.json")
            return facts
        from dflash_cli.stages.compile_ort import compile_ort

        return compile_ort(ctx)


def _qaic_options(recipe: Any):
    from dflash_cli.qaic.command import QaicCompileOptions

    return QaicCompileOptions.from_mapping(recipe.compile.qaic.model_dump())


STAGE = CompileStage()
