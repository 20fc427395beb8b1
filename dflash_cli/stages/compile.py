"""compile stage: exported graphs -> runnable programs for the recipe's backend.

ONNX Runtime (default): the exported graphs' weights as they are (fp32/fp16, hard-linked, no copy)
or with MatMul weights quantised weight-only to int8/int4 (MatMulNBits, dflash_cli.ortcompile); the
graphs rewritten for ONNX Runtime's fused kernels (ortcompile.fuse, `compile.ort.fuse`); then a
smoke call, the fused graphs against the unfused ones, and a causal-invariance check of the target,
when the graphs fit the build's memory budget.
QAIC: the Cloud AI 100 compiler (dflash_cli.qaic).
"""

from __future__ import annotations

import json
import shutil
from typing import Any

from dflash_cli.errors import DFlashError
from dflash_cli.stages.base import StageContext

CHECK_FLOOR_BYTES = 1 << 30  # graphs this small are always loaded and checked at build time


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
            from dflash_cli.modeling.families import require_qaic_support
            from dflash_cli.qaic.compile import key_fields as qaic_key_fields
            from dflash_cli.qaic.sdk import find_sdk

            require_qaic_support(recipe.family)  # refused while the build is planned
            return {"backend": "qaic", **qaic_key_fields(_qaic_options(recipe), find_sdk())}
        fields = {"backend": "ort", "precision": c.ort.precision, "fuse": c.ort.fuse}
        if c.ort.fuse:
            fields["fuse_attention"] = c.ort.fuse_attention
        if c.ort.precision != "fp32":
            fields["block_size"] = c.ort.block_size
            fields["accuracy_level"] = accuracy_level(recipe)
        return fields

    def run(self, ctx: StageContext) -> dict[str, Any]:
        if ctx.recipe.compile.backend == "qaic":
            from dflash_cli.qaic.compile import compile_graphs

            src = ctx.inputs["export"]
            facts = compile_graphs(src, ctx.out_dir, _qaic_options(ctx.recipe), ctx.progress)
            shutil.copy2(src / "export.json", ctx.out_dir / "export.json")
            return facts
        return _compile_ort(ctx)


def _is_hybrid_family(family: str) -> bool:
    from dflash_cli.modeling.families import FAMILIES

    return bool(FAMILIES.get(family) and FAMILIES[family].hybrid)


def accuracy_level(recipe: Any) -> int:
    """compile.ort.accuracy_level, or its default for the recipe's family: 4 (int8 compute), but 0 (fp32)
    for a hybrid linear-attention target. Its delta rule rounds in the last bits differently in calls of
    other lengths, and activations quantised to int8 turn that into other tokens: on the Qwen3.5-9B shape
    at level 4, greedy DFlash left greedy plain decoding at the second token."""
    level = recipe.compile.ort.accuracy_level
    if level is not None:
        return level
    return 0 if _is_hybrid_family(recipe.family) else 4


def _check_call_length(sess, info: dict, vocab_size: int, facts: dict, progress) -> None:
    """One-token calls as they are, else as two rows (backends/single_row.py), else the static graphs."""
    from dflash_cli.ortcompile.checks import call_length_invariance

    # A hybrid target's delta rule runs in block form: a position's features round differently in calls of
    # other lengths (1e-6 on the tiny pairs, 1e-4 on the Qwen3.5-9B shape), in the static graphs as much as
    # here, so only its tokens must agree (the features feed the draft, not the output).
    hybrid = any(n.startswith("past_delta") for n in info["graphs"]["target"]["inputs"])

    def moved_too_far(diffs: dict) -> bool:
        return any(v > 0.0 for k, v in diffs.items() if k == "tokens" or not hybrid)

    sess.pad_single_rows = False
    moved, rows = call_length_invariance(sess, info, vocab_size), "one row"
    if moved_too_far(moved):
        sess.pad_single_rows = True
        moved, rows = call_length_invariance(sess, info, vocab_size), "two rows"
    facts["prefix_call_length_max_diff"] = moved
    if not moved_too_far(moved):
        facts["prefix_one_token_calls"] = rows
    else:  # the engine then runs the static graphs (fixed call shapes)
        facts["prefix_target_lossless"] = False
        progress(
            "warning: on this machine's ONNX Runtime the prefix-cache target's outputs depend on the call's "
            "length; `dflash run` will use the static graphs (lossless, slower)"
        )


def _check_batches(path, sess, info: dict, vocab_size: int, settings, facts: dict, budget: int) -> None:
    """Batch invariance of an in-place target that takes several sequences (backends/batch_invariance.py).
    `sess`: the open prefix-cache session, which serves the check's calls of one sequence."""
    import onnx

    from dflash_cli.backends.ort_kv_inplace import OrtInPlaceKvSession

    first = onnx.load(str(path), load_external_data=False).graph.input[0].type.tensor_type.shape.dim[0]
    if facts.get("prefix_target_lossless") is False or not isinstance(sess, OrtInPlaceKvSession):
        return
    if first.dim_param != "batch":  # built before batching
        return
    from dflash_cli.backends.batch_invariance import batch_invariance
    from dflash_cli.backends.ort_batched import PACKED_WEIGHTS
    from dflash_cli.ortcompile.checks import graph_weight_bytes
    from dflash_cli.process_memory import available_bytes

    # One more session, for calls of several sequences: its own packed copy of the weights, beside the one open.
    extra, free = graph_weight_bytes(path), available_bytes()
    if 2 * extra > budget:
        facts["batch_invariance"] = {"equal": False, "skipped": "a second target session is above the build's budget"}
        return
    if free is not None and PACKED_WEIGHTS * extra > free:
        facts["batch_invariance"] = {"equal": False, "skipped": "a second target session does not fit in memory"}
        return
    pad = facts.get("prefix_one_token_calls") != "one row"
    facts["batch_invariance"] = batch_invariance(path, info, vocab_size, settings, pad, one=sess._sess)


def _note_unfused_attention(facts: dict, why: str, progress) -> None:
    facts["prefix_attention"] = f"unfused ({why})"
    progress(f"note: target_prefix attention: unfused ({why})")


def _ort_errors() -> tuple[type[BaseException], ...]:
    """What ONNX Runtime raises when it refuses a graph or a kernel refuses its inputs (its pybind errors
    derive from Exception; a run through IOBinding raises RuntimeError)."""
    from onnxruntime.capi import onnxruntime_pybind11_state as state

    names = ("Fail", "InvalidArgument", "InvalidGraph", "InvalidProtobuf", "NotImplemented", "RuntimeException")
    return (RuntimeError, *(getattr(state, n) for n in names if hasattr(state, n)))


def _refusal(exc: BaseException) -> str:
    """ONNX Runtime's own words, without the executor's preamble."""
    text = " ".join(str(exc).split())
    return text.split("Status Message: ", 1)[-1] or type(exc).__name__


def _unfused_if_refused(check, gname: str, out, info: dict, unfused: dict, facts: dict, progress) -> None:
    """Run `check` (opens and checks the graph `gname`); where ONNX Runtime refuses its GroupQueryAttention
    (ortcompile/gqa.py checks what the kernel accepts, but this ONNX Runtime may know other limits), rewrite
    the graph again without the attention rewrite, say why, and check that instead of failing the build."""
    fused = facts.get(f"{gname}_fused") or {}
    if not fused.get("attention") or gname not in unfused:
        check()
        return
    try:
        check()
        return
    except _ort_errors() as exc:
        what = "GroupQueryAttention" if "GroupQueryAttention" in str(exc) else "the GroupQueryAttention graph"
        why = f"ONNX Runtime refused {what}: {_refusal(exc)}"
    from dflash_cli.ortcompile.fuse import fuse_graph

    path = out / info["graphs"][gname]["onnx"]
    redo = path.with_name(path.stem + ".refused.onnx")
    result = fuse_graph(unfused[gname], redo, attention=False)
    redo.replace(path)
    fused.update(attention=0, row_pads_merged=result.merged_pads, skipped=[*result.skipped, f"attention: {why}"])
    _note_unfused_attention(facts, why, progress)
    check()


def _qaic_options(recipe: Any):
    from dflash_cli.qaic.command import QaicCompileOptions

    return QaicCompileOptions.from_mapping(recipe.compile.qaic.model_dump())


def _compile_ort(ctx: StageContext) -> dict[str, Any]:
    from dflash_cli.backends.ort import OrtSession, OrtSettings
    from dflash_cli.backends.ort_prefix import open_prefix_session
    from dflash_cli.exporting.weight_sources import SourceReader
    from dflash_cli.ortcompile.checks import (
        causal_invariance,
        graph_weight_bytes,
        matches_reference,
        reference_outputs,
        smoke,
    )
    from dflash_cli.ortcompile.fuse import fuse_graph
    from dflash_cli.ortcompile.quantize import quantize_graph
    from dflash_cli.process_memory import release_memory
    from dflash_cli.weights import link_or_copy

    src, out = ctx.inputs["export"], ctx.out_dir
    info = json.loads((src / "export.json").read_text())
    ort_cfg = ctx.recipe.compile.ort
    precision = ort_cfg.precision
    # The export's graphs and data files are hard-linked, never copied: fp32 uses them as they are,
    # int8/int4 keep their unquantised weights (embedding, norms) in them.
    for path in sorted(src.iterdir()):
        if path.suffix in (".onnx", ".data") and not (precision != "fp32" and path.suffix == ".onnx"):
            link_or_copy(path, out / path.name)
    if info.get("lean") and precision == "fp32":  # the stage keys rule this out: a cache edited by hand
        raise DFlashError(
            "this export leaves out the checkpoint's weights (an int8/int4 build's); an fp32 compile needs them",
            hint="rebuild the export: `dflash build --rebuild export`",
        )
    facts: dict[str, Any] = {"backend": "ort", "precision": precision}
    quantized = precision != "fp32"
    if precision != "fp32":
        bits = 8 if precision == "int8" else 4
        facts["block_size"] = ort_cfg.block_size
        level = facts["accuracy_level"] = accuracy_level(ctx.recipe)
        if level and _is_hybrid_family(ctx.recipe.family):
            ctx.progress(
                "warning: compile.ort.accuracy_level=4 quantises activations to int8, which turns the delta rule's "
                "last-bit rounding (it differs between call lengths) into other tokens: greedy DFlash may leave "
                "greedy plain decoding; leave accuracy_level unset (0 for this family) to keep it lossless"
            )
        done: dict = {}  # quantised once, referenced by both graphs (the draft's lm_head is the target's)
        for gname, g in info["graphs"].items():
            ctx.progress(f"quantising {gname} MatMul weights to int{bits} (weight-only, block {ort_cfg.block_size})")
            source = SourceReader.for_graph(src, g["onnx"])
            result = quantize_graph(
                src / g["onnx"],
                out / g["onnx"],
                bits=bits,
                block_size=ort_cfg.block_size,
                accuracy_level=level,
                progress=ctx.progress,
                done=done,
                fuse_siblings=ort_cfg.fuse,  # q/k/v and gate/up stacked into one MatMulNBits each
                source=source,
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
    unfused: dict[str, Any] = {}  # graph -> the unfused .onnx (beside its data) to check the fused one against
    if "target_prefix" in info["graphs"] and not (ort_cfg.fuse and ort_cfg.fuse_attention):
        off = "compile.ort.fuse" if not ort_cfg.fuse else "compile.ort.fuse_attention"
        facts["prefix_attention"] = f"unfused ({off} is false)"
    if ort_cfg.fuse:
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
                    _note_unfused_attention(facts, why or "not rewritten", ctx.progress)
            keep = path.with_name(path.stem + ".unfused.onnx")
            path.rename(keep)  # a hard link to the export for fp32: renaming never touches the export's file
            fused.rename(path)
            unfused[gname] = keep
    weights = {g: graph_weight_bytes(out / v["onnx"]) for g, v in info["graphs"].items()}
    facts["session_weight_bytes"] = weights
    budget = max(CHECK_FLOOR_BYTES, int(info.get("target_checkpoint_bytes", 0)))
    # A prefix-cache graph reads the same weights; a vision tower is checked against its export on its own.
    static = [g for g in info["graphs"] if not g.endswith("_prefix") and g != "vision"]
    if sum(weights[g] for g in static) <= budget:
        settings = OrtSettings(intra_op_threads=ort_cfg.intra_op_threads, graph_optimization=ort_cfg.graph_optimization)
        pair = json.loads((src / "pair.json").read_text())
        done = ["smoke"]
        for gname in static:
            g = info["graphs"][gname]
            # The exported graph's outputs on the check's calls; then one graph in memory at a time.
            ctx.progress(f"running the exported {gname} for the compiled graphs' checks")
            reference_sess = OrtSession(unfused.get(gname, out / g["onnx"]), gname, settings)
            reference = reference_outputs(reference_sess, gname, info, pair["vocab_size"])
            del reference_sess
            release_memory()  # glibc keeps a freed session's pages (4.4 GB at the 4B int4 shape) unless trimmed
            checks = "smoke call, causal-invariance check" if gname == "target" else "smoke call"
            ctx.progress(f"loading {gname} in ONNX Runtime ({checks})")
            sess = OrtSession(out / g["onnx"], gname, settings)
            smoke(sess, gname, info)
            if gname in unfused:
                facts[f"{gname}_fused_max_diff"] = matches_reference(
                    sess, reference, f"fused {gname}", info["dtype"], quantized
                )
            if gname == "target":
                facts["causal_invariance_max_diff"] = causal_invariance(sess, info, pair["vocab_size"])
            del sess
            release_memory()
            prefix_graph = info["graphs"].get(f"{gname}_prefix")
            if prefix_graph:
                ctx.progress(f"checking the prefix-cache {gname} against the exported graph")

                def check_prefix(gname=gname, prefix_graph=prefix_graph, reference=reference) -> None:
                    sess = open_prefix_session(out / prefix_graph["onnx"], gname, info["ctx_len"], settings)
                    label = f"prefix-cache {gname}"
                    diff = matches_reference(sess, reference, label, info["dtype"], quantized)
                    facts[f"{gname}_prefix_max_diff"] = diff
                    if gname == "target":  # what decoding runs on the CPU: its positions must stay independent too
                        facts["prefix_causal_invariance_max_diff"] = causal_invariance(sess, info, pair["vocab_size"])
                        _check_call_length(sess, info, pair["vocab_size"], facts, ctx.progress)
                        _check_batches(
                            out / prefix_graph["onnx"], sess, info, pair["vocab_size"], settings, facts, budget
                        )

                _unfused_if_refused(check_prefix, f"{gname}_prefix", out, info, unfused, facts, ctx.progress)
                release_memory()
        done += ["fused vs unfused"] if unfused else []
        done += ["prefix cache vs static"] if any(g.endswith("_prefix") for g in info["graphs"]) else []
        done += ["call length"] if "target_prefix" in info["graphs"] else []
        facts["checks"] = " + ".join([*done, "causal invariance"])
    else:
        # Loading the graphs here would hold more than the build's memory bound (1.5x the checkpoint);
        # `dflash run` is their first load. int8/int4 builds of the same pair fit and are checked.
        facts["checks"] = (
            f"skipped: the graphs hold {sum(weights[g] for g in static) / 1e9:.1f} GB, above this build's memory "
            "budget "
            f"({budget / 1e9:.1f} GB)"
        )
        ctx.progress(f"checks {facts['checks']}")
        if "target_prefix" in info["graphs"] and weights["target_prefix"] <= budget:
            # What decoding runs alone fits: how its one-token calls must run is still worth knowing.
            ctx.progress("loading the prefix-cache target (call-length check)")
            settings = OrtSettings(ort_cfg.intra_op_threads, ort_cfg.graph_optimization)
            prefix_graph = out / info["graphs"]["target_prefix"]["onnx"]
            vocab = json.loads((src / "pair.json").read_text())["vocab_size"]

            def check_call_length() -> None:
                sess = open_prefix_session(prefix_graph, "target", info["ctx_len"], settings)
                _check_call_length(sess, info, vocab, facts, ctx.progress)
                ctx.progress("checking batch invariance (serving several requests in one call)")
                _check_batches(prefix_graph, sess, info, vocab, settings, facts, budget)

            _unfused_if_refused(check_call_length, "target_prefix", out, info, unfused, facts, ctx.progress)
            facts["checks"] += "; call length and batch invariance checked"
    for keep in unfused.values():
        keep.unlink()
    shutil.copy2(src / "export.json", out / "export.json")
    shutil.copy2(src / "pair.json", out / "pair.json")
    (out / "compile.json").write_text(json.dumps(facts, indent=2) + "\n")
    return facts


STAGE = CompileStage()
