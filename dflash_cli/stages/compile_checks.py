"""The compile's checks, on graphs that fit the build's memory budget: a smoke call, the fused graphs against
the unfused ones, the prefix-cache graphs against the static ones, causal invariance of the target, and how
one-token calls must run (call length) and whether several sequences share a call exactly (batch invariance).
"""

from __future__ import annotations

import json
from pathlib import Path

from dflash_cli.stages.base import StageContext

CHECK_FLOOR_BYTES = 1 << 30  # graphs this small are always loaded and checked at build time


def check_graphs(ctx: StageContext, src: Path, out: Path, info: dict, unfused: dict, facts: dict) -> None:
    from dflash_cli.ortcompile.checks import graph_weight_bytes

    weights = {g: graph_weight_bytes(out / v["onnx"]) for g, v in info["graphs"].items()}
    facts["session_weight_bytes"] = weights
    budget = max(CHECK_FLOOR_BYTES, int(info.get("target_checkpoint_bytes", 0)))
    # A prefix-cache graph reads the same weights; a vision tower is checked against its export on its own.
    static = [g for g in info["graphs"] if not g.endswith("_prefix") and g != "vision"]
    if sum(weights[g] for g in static) <= budget:
        _check_all(ctx, src, out, info, unfused, facts, static, budget)
        return
    # Loading the graphs here would hold more than the build's memory bound (1.5x the checkpoint);
    # `dflash run` is their first load. int8/int4 builds of the same pair fit and are checked.
    facts["checks"] = (
        f"skipped: the graphs hold {sum(weights[g] for g in static) / 1e9:.1f} GB, above this build's memory "
        "budget "
        f"({budget / 1e9:.1f} GB)"
    )
    ctx.progress(f"checks {facts['checks']}")
    if "target_prefix" in info["graphs"] and weights["target_prefix"] <= budget:
        _check_prefix_alone(ctx, src, out, info, unfused, facts, budget)


def _check_all(ctx, src: Path, out: Path, info: dict, unfused: dict, facts: dict, static: list, budget: int) -> None:
    from dflash_cli.backends.ort import OrtSession, OrtSettings
    from dflash_cli.host.memory import release_memory
    from dflash_cli.ortcompile.checks import causal_invariance, matches_reference, reference_outputs, smoke

    ort_cfg = ctx.recipe.compile.ort
    quantized, rows = ort_cfg.precision != "fp32", ort_cfg.precision == "w8a8"
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
                sess, reference, f"fused {gname}", info["dtype"], quantized, rows
            )
        if gname == "target":
            facts["causal_invariance_max_diff"] = causal_invariance(sess, info, pair["vocab_size"])
        del sess
        release_memory()
        prefix_graph = info["graphs"].get(f"{gname}_prefix")
        if prefix_graph:
            ctx.progress(f"checking the prefix-cache {gname} against the exported graph")

            def check_prefix(gname=gname, prefix_graph=prefix_graph, reference=reference) -> None:
                from dflash_cli.backends.ort_prefix import open_prefix_session

                sess = open_prefix_session(out / prefix_graph["onnx"], gname, info["ctx_len"], settings)
                label = f"prefix-cache {gname}"
                diff = matches_reference(sess, reference, label, info["dtype"], quantized, rows)
                facts[f"{gname}_prefix_max_diff"] = diff
                if gname == "target":  # what decoding runs on the CPU: its positions must stay independent too
                    facts["prefix_causal_invariance_max_diff"] = causal_invariance(sess, info, pair["vocab_size"])
                    _check_call_length(sess, info, pair["vocab_size"], facts, ctx.progress)
                    _check_batches(out / prefix_graph["onnx"], sess, info, pair["vocab_size"], settings, facts, budget)

            _unfused_if_refused(check_prefix, f"{gname}_prefix", out, info, unfused, facts, ctx.progress)
            release_memory()
    done += ["fused vs unfused"] if unfused else []
    done += ["prefix cache vs static"] if any(g.endswith("_prefix") for g in info["graphs"]) else []
    done += ["call length"] if "target_prefix" in info["graphs"] else []
    facts["checks"] = " + ".join([*done, "causal invariance"])


def _check_prefix_alone(ctx, src: Path, out: Path, info: dict, unfused: dict, facts: dict, budget: int) -> None:
    """What decoding runs alone fits: how its one-token calls must run is still worth knowing."""
    from dflash_cli.backends.ort import OrtSettings
    from dflash_cli.backends.ort_prefix import open_prefix_session

    ort_cfg = ctx.recipe.compile.ort
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


def _check_call_length(sess, info: dict, vocab_size: int, facts: dict, progress) -> None:
    """One-token calls as they are, else as two rows (backends/single_row.py), else the static graphs."""
    from dflash_cli.ortcompile.checks import call_length_invariance

    # Every output, features too (a hybrid target's delta rule runs row by row in this graph: exact as well).
    def moved_too_far(diffs: dict) -> bool:
        return any(v > 0.0 for v in diffs.values())

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
    from dflash_cli.host.memory import available_bytes
    from dflash_cli.ortcompile.checks import graph_weight_bytes

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


def note_unfused_attention(facts: dict, why: str, progress) -> None:
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
    note_unfused_attention(facts, why, progress)
    check()
