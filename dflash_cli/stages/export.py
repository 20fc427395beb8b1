"""export stage: the injected pair -> target.onnx + draft.onnx (only `seq_len` symbolic), validated.

The dynamo path traces on the meta device and streams weights into external data in
`export.dtype` (see exporting/graphs.py), so memory stays near one tensor plus the validation.
Validation runs the real graphs when they are small; for larger pairs it checks a reduced model (the
first layers and vocabulary rows of the same checkpoint, every other shape unchanged, exporting/
reduced.py) grown from the same traced layers, against PyTorch and Hugging Face, so its memory does
not grow with depth or vocabulary. Either way any output over tolerance fails the stage.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from dflash_cli.errors import ExportValidationError, RecipeError
from dflash_cli.recipe.schema import export_shape_problems
from dflash_cli.stages.base import StageContext

FULL_VALIDATION_BYTES = 1 << 30  # float32 bytes of both graphs up to which the real graphs are validated


# Bumped whenever the traced graphs change, so cached exports made by older code are rebuilt:
# 2 = fp16-finite mask constant (was float32's minimum, -inf under a compiler's fp16 conversion);
# 3 = RoPE cos/sin looked up in tables by position (was the angle computed in the graph);
# 4 = the RoPE padding map as Where (3 used Clip, which is not on the QAIC op allow-list);
# 5 = two-pass RMSNorm (finite in fp16 for |x| up to fp16's max) and V zeroed in cache slots no query sees;
# 6 = scalar fill values in Where (5 expanded full-size constants for the mask, V and the norm floor);
# 7 = also the prefix-cache twins target_prefix.onnx / draft_prefix.onnx that ONNX Runtime runs;
# 8 = grown from one traced decoder layer (exporting/replicate.py); equal initializers no longer merged;
# 9 = the dense prefix graphs take a symbolic batch (several sequences per call);
# 10 = the draft also returns draft_confidence (its probability of each proposed token), via logsumexp;
# 11 = draft_confidence via TopK / Exp / ReduceMean (finite in fp16, on the QAIC op list);
# 12 = a DFlash draft's prefix graph drafts a block of any length (symbolic `block_len`);
# 13 = attention reshapes by -1 (shape inference resolves them with a symbolic batch), and the "_cb" graphs;
# 14 = a mixture-of-experts router is a MatMul on the 3-D hidden states (was a Gemm on them flattened), and
#      draft_confidence divides by sqrt(V) twice (V itself overflowed fp16: `dflash check` failed real vocabularies).
# 15 = a DFlash draft's prefix graph takes `proposal_rows`: only that many proposals go through its head.
# 16 = a hybrid target's prefix graph runs its delta rule, fold and attention row by row (ONNX Scan).
GRAPH_REVISION = 16


class ExportStage:
    name = "export"
    version = 2
    upstream = ("inject",)
    tools: tuple[str, ...] = ("torch", "transformers", "onnx", "onnxscript", "onnx_ir")

    def key_fields(self, recipe: Any) -> dict[str, Any]:
        e = recipe.export
        return {
            **({"weights": "lean"} if lean_export(recipe) else {}),
            "graph_revision": GRAPH_REVISION,
            "ctx_len": e.ctx_len,
            "prefill_seq_len": e.prefill_seq_len,
            "opset": e.opset,
            "exporter": e.exporter,
            "dtype": e.dtype,
            "logits": e.logits,
            "validate": e.validate_outputs,
            **({"full_batch_size": full_batch_size(recipe)} if full_batch_size(recipe) else {}),
            **({"moe_ops": moe_ops(recipe)} if moe_ops(recipe) != "ort" else {}),
        }

    def run(self, ctx: StageContext) -> dict[str, Any]:
        from dflash_cli.exporting.options import PairShape
        from dflash_cli.modeling.loading import load_pair_info

        e = ctx.recipe.export
        src = ctx.inputs["inject"]
        pair = load_pair_info(src)
        B, P, C = pair["block_size"], e.prefill_seq_len, e.ctx_len
        _check_settings(ctx.recipe, src, B)
        out = ctx.out_dir
        shape = PairShape(B, P, C, pair["hidden_size"])
        lean = lean_export(ctx.recipe)
        options, reduced = _validation_plan(ctx, src, pair, lean)
        graphs = _export_graphs(ctx, src, shape, options, reduced)
        checks: list = []
        mode = "off"
        if options.validation != "off":
            checks, mode = _validate(ctx, src, shape, options, pair, reduced)
        shutil.copy2(src / "pair.json", out / "pair.json")
        info = {
            "block_size": B,
            "ctx_len": C,
            "prefill_seq_len": P,
            "logits": e.logits,
            "dtype": e.dtype,
            "lean": lean,
            "target_checkpoint_bytes": _checkpoint_bytes(src / "target"),
            "graphs": graphs,
        }
        (out / "export.json").write_text(json.dumps(info, indent=2) + "\n")
        return {
            "validated_outputs": len(checks),
            "validation": mode,
            "data_bytes": {g: v.get("data_bytes") for g, v in graphs.items()},
            "export_seconds": {g: v.get("seconds") for g, v in graphs.items()},
        }


def _check_settings(recipe: Any, src: Path, block_size: int) -> None:
    """Refuse export settings the graphs cannot take, before anything is traced."""
    from dflash_cli.modeling.dflash2_config import check_window

    e = recipe.export
    C = e.ctx_len
    # The recipe checked these already, unless the block size is the draft's.
    problems = export_shape_problems(block_size, e.prefill_seq_len, C)
    check_window(json.loads((src / "draft" / "config.json").read_text()), C)
    if problems:
        raise RecipeError(problems[0], hint="set export.prefill_seq_len / export.ctx_len in the recipe or by --set")
    if e.exporter == "torchscript" and full_batch_size(recipe):
        raise RecipeError("compile.qaic.full_batch_size needs the dynamo exporter", hint="--set export.exporter=dynamo")
    if e.exporter == "torchscript" and e.dtype != "fp32":
        raise RecipeError(
            "export.exporter=torchscript supports export.dtype=fp32 only",
            hint="--set export.exporter=dynamo for fp16 graphs",
        )


def _validation_plan(ctx: StageContext, src: Path, pair: dict, lean: bool):
    """(the export's options, the reduced model's graphs when the validation checks one, else None)."""
    from dflash_cli.exporting.options import ExportOptions

    e = ctx.recipe.export
    validation = "off"
    if e.validate_outputs:  # a large pair validates a reduced model: memory bounded whatever its size
        # (and a lean export's own graphs cannot run: their weights are left out)
        validation = "reduced" if lean or _fp32_bytes(src) > FULL_VALIDATION_BYTES else "full"
    options = ExportOptions.of(e, validation, lean, full_batch_size(ctx.recipe), moe_ops(ctx.recipe))
    if lean:
        ctx.progress("lean export: the compile reads the checkpoint's weights from the checkpoint (export.weights)")
    reduced = None
    if options.validation == "reduced":
        from dflash_cli.exporting.reduced import ReducedGraphs, ReducedPlan

        plan = ReducedPlan.of(src, pair)
        too_big = _validation_does_not_fit(plan.fp32_bytes(src))
        if too_big:  # the kernel would kill the build without a word; say why and go on unvalidated
            ctx.progress(f"validation skipped: {too_big} (the compile stage still checks its graphs)")
            options = ExportOptions.of(e, "off", lean, full_batch_size(ctx.recipe), moe_ops(ctx.recipe))
        else:
            reduced = ReducedGraphs(src, ctx.out_dir, plan, options)
    return options, reduced


def _export_graphs(ctx: StageContext, src: Path, shape, options, reduced) -> dict[str, Any]:
    """Trace and write the graphs (with the reduced model's, when there is one); returns their facts."""
    e = ctx.recipe.export
    if e.exporter != "dynamo":
        return _export_torchscript(src, ctx.out_dir, shape, e, ctx.progress)
    import torch

    from dflash_cli.exporting.graphs import export_pair

    ctx.progress(f"tracing on the meta device and streaming {e.dtype} weights (opset {e.opset})")
    # One torch thread: the writer and hasher threads take the other core (a second OpenMP thread
    # mostly spun between conversions; benchmarks/results/scale/export-threads-s10.txt).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return export_pair(src, ctx.out_dir, shape, options, ctx.progress, reduced)
    except BaseException:
        if reduced is not None:
            reduced.remove()
        raise
    finally:
        torch.set_num_threads(threads)


def _validate(ctx: StageContext, src: Path, shape, options, pair: dict, reduced) -> tuple[list, str]:
    """Check the graphs' outputs against PyTorch (validation.json); raises when any is over tolerance."""
    from dflash_cli.exporting.validate import validate_export

    out = ctx.out_dir
    checks, mode = validate_export(src, out, shape, options, pair, reduced=reduced, progress=ctx.progress)
    (out / "validation.json").write_text(
        json.dumps({"mode": mode, "checks": [c.to_dict() for c in checks]}, indent=2) + "\n"
    )
    bad = [c for c in checks if not c.ok]
    ctx.progress(
        f"validation ({mode}): {len(checks) - len(bad)}/{len(checks)} outputs within tolerance; "
        f"largest relative gap {max((c.max_diff / c.tolerance for c in checks if c.tolerance), default=0):.2g}"
        " of tolerance (table in validation.json)"
    )
    if bad:
        raise ExportValidationError(
            f"export validation failed: {bad[0].graph} {bad[0].output} ({bad[0].call}) differs by "
            f"{bad[0].max_diff:.3g} > {bad[0].tolerance:.3g} ({len(bad)} outputs over tolerance)",
            hint="see validation.json in the export artifact; try `--set export.exporter=torchscript`",
        )
    return checks, mode


def lean_export(recipe: Any) -> bool:
    """Whether the export leaves the checkpoint's weights out: only its compile reads it, and that compile
    quantises every weight it would read from the export (an int8/int4 ONNX Runtime build)."""
    c = recipe.compile
    e = recipe.export
    return e.weights == "auto" and e.exporter == "dynamo" and c.backend == "ort" and c.ort.precision != "fp32"


def full_batch_size(recipe: Any) -> int:
    """The sequences a QAIC build's caches hold, where above 1 (its export then writes the "_cb" graphs), else 0."""
    c = recipe.compile
    return c.qaic.full_batch_size if c.backend == "qaic" and c.qaic.full_batch_size > 1 else 0


def moe_ops(recipe: Any) -> str:
    """How a mixture-of-experts target's experts are written: standard ops for QAIC (its compiler has no MoE op),
    ONNX Runtime's MoE op otherwise (exporting/options.py)."""
    from dflash_cli.families import FAMILIES

    fam = FAMILIES.get(recipe.family)
    return "gathered" if recipe.compile.backend == "qaic" and fam is not None and fam.moe else "ort"


def _checkpoint_bytes(target_dir: Path) -> int:
    """Bytes of the target's weight files as the user supplied them (the build's memory yardstick)."""
    from dflash_cli.checkpoints.weights import WeightStore

    return sum(
        (target_dir / f).stat().st_size for f in WeightStore.open(target_dir).files() if f != "dflash.safetensors"
    )


# The reduced model's checks hold its weights twice (PyTorch's module, ONNX Runtime's session), plus working room.
VALIDATION_COPIES, VALIDATION_ROOM = 2, 1 << 30


def _validation_does_not_fit(fp32_bytes: int) -> str | None:
    from dflash_cli.host.memory import available_bytes

    need, free = VALIDATION_COPIES * fp32_bytes + VALIDATION_ROOM, available_bytes()
    if free is None or need <= 0.9 * free:  # sessions also allocate arenas and activations
        return None
    return f"the reduced model's checks need ~{need / 2**30:.1f} GiB, {free / 2**30:.1f} GiB is available"


def _fp32_bytes(src: Path) -> int:
    """float32 bytes of the distinct tensors of both graphs (the draft's embedding/lm_head are the target's)."""
    from dflash_cli.checkpoints.weights import WeightStore

    seen, total = set(), 0
    for role in ("target", "draft"):
        store = WeightStore.open(src / role)
        for ref in store.refs.values():
            ident = (ref.file.removeprefix("target."), ref.key)
            if ident not in seen:
                seen.add(ident)
                n = 1
                for d in ref.shape:
                    n *= d
                total += 4 * n
    return total


def _export_torchscript(src: Path, out: Path, shape, e, progress) -> dict[str, Any]:
    """The TorchScript exporter needs the weights in memory (fp32): for small pairs and as a fallback."""
    from dflash_cli.exporting.graphs import example_inputs_real, graph_facts
    from dflash_cli.exporting.torch_to_onnx import export_module
    from dflash_cli.modeling.draft import StaticCacheDraft
    from dflash_cli.modeling.loading import load_draft, load_target

    progress("loading the injected target and draft (TorchScript exporter: weights in memory)")
    graphs = {}
    for gname, module, sym in (
        ("target", load_target(src, emit_logits=e.logits), {"input_ids": 1, "position_ids": 1}),
        (
            "draft",
            StaticCacheDraft(load_draft(src), emit_logits=e.logits).eval(),
            {"context_features": 1, "context_position_ids": 1},
        ),
    ):
        progress(f"exporting {gname}.onnx (torchscript, opset {min(e.opset, 17)})")
        ins, outs = module.io_names()
        export_module(module, example_inputs_real(gname, module, shape), ins, outs, sym, out / f"{gname}.onnx")
        graphs[gname] = graph_facts(gname, module, shape)
        del module
    return graphs


STAGE = ExportStage()
