"""Export validation: every ONNX output against the PyTorch module, and the target against Hugging Face.

One row per (graph, call, output) with the max difference and its tolerance; any row over
tolerance fails the stage (the caller raises), never just a warning.
"""

from __future__ import annotations

import shutil
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dflash_cli.exporting.options import CONFIDENCE_ATOL, CONFIDENCE_OUTPUT
from dflash_cli.exporting.reduced import GRAPHS, TRACED_DIR, ReducedGraphs, ReducedPlan

RTOL = {"fp32": 1e-3, "fp16": 2e-2}  # relative to the reference's largest magnitude (summation order, fp16 rounding)
# fp16 graphs against a float32 reference: argmax may flip where two logits are within fp16 rounding
# (random-weight models are full of such near ties); more than this fraction is a conversion fault.
TOKEN_TOL = {"fp32": 0.0, "fp16": 0.1}


@dataclass(frozen=True)
class Check:
    graph: str
    call: str
    output: str
    max_diff: float
    tolerance: float

    @property
    def ok(self) -> bool:
        return self.max_diff <= self.tolerance

    def line(self) -> str:
        mark = "ok" if self.ok else "FAIL"
        head = f"{self.graph:6s} {self.call:18s} {self.output:32s}"
        return f"{head} max|diff| {self.max_diff:.3g} (tol {self.tolerance:.3g}) {mark}"

    def to_dict(self) -> dict:
        return {**asdict(self), "ok": self.ok}


def _diff(name: str, got: np.ndarray, ref: np.ndarray, dtype: str = "fp32") -> tuple[float, float]:
    if np.issubdtype(ref.dtype, np.integer):
        # Token ids: the fraction of positions that disagree.
        return float(np.mean(got != ref)), TOKEN_TOL[dtype]
    # In float32 (fp16 outputs widened): the subtraction's own rounding (~6e-8 relative) is far below
    # any tolerance, and float64 copies of every cache output cost more than the graphs' runs.
    got = got.astype(np.float32, copy=False)
    ref = ref.astype(np.float32, copy=False)
    tol = CONFIDENCE_ATOL[dtype] if name == CONFIDENCE_OUTPUT else RTOL[dtype] * max(1.0, float(np.max(np.abs(ref))))
    return float(np.max(np.abs(got - ref))), tol


def _session(onnx_path: Path):
    import onnxruntime as ort

    from dflash_cli.host.ort_threads import apply_thread_pool

    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    opts.add_session_config_entry("session.intra_op.allow_spinning", "0")  # a spinning pool would outlive the checks
    apply_thread_pool(opts)
    return ort.InferenceSession(str(onnx_path), sess_options=opts, providers=["CPUExecutionProvider"])


def compare_graph(
    graph: str,
    onnx_path: Path,
    module: torch.nn.Module,
    calls: list[tuple[str, dict]],
    ctx_len: int,
    dtype: str = "fp32",
) -> list[Check]:
    """Run the same sequence of calls through ONNX Runtime and the float32 module, threading each one's cache."""
    sess = _session(onnx_path)
    float_type = {i.name: (np.float16 if i.type == "tensor(float16)" else np.float32) for i in sess.get_inputs()}
    in_names, out_names = module.io_names()
    cache_names = [n for n in in_names if n.startswith("past_")]
    past = [t.numpy() for t in module.empty_cache(ctx_len)]
    checks = []
    for label, feeds in calls:
        feeds = _with_text_inputs(module, feeds)
        args = [torch.from_numpy(feeds[n]) for n in in_names if n not in cache_names]
        with torch.no_grad():
            ref = [t.numpy() for t in module(*args, *[torch.from_numpy(p) for p in past])]
        onnx_feeds = {**feeds, **dict(zip(cache_names, past))}
        onnx_feeds = {
            n: (v.astype(float_type[n], copy=False) if v.dtype == np.float32 else v) for n, v in onnx_feeds.items()
        }
        got = sess.run(None, onnx_feeds)
        for name, g, r in zip(out_names, got, ref):
            d, tol = _diff(name, g, r, dtype)
            checks.append(Check(graph, label, name, d, tol))
        past = ref[len(out_names) - len(cache_names) :]
    return checks


def _with_text_inputs(module, feeds: dict) -> dict:
    """A vision-language target's neutral image inputs for a text call (modeling/vl_target.py)."""
    extra = getattr(module, "extra_inputs", ())
    if not extra or all(n in feeds for n in extra):
        return feeds
    values = module.text_inputs(torch.from_numpy(feeds["position_ids"]))
    return {**dict(zip(extra, (v.numpy() for v in values))), **feeds}


def target_vs_hf(hf, module, prompt: np.ndarray, ctx_len: int) -> list[Check]:
    """Our static-cache target against the plain Hugging Face forward on one prompt (logits' argmax and the
    fused features recomputed from HF hidden_states[i + 1])."""
    ids = torch.from_numpy(prompt)
    pos = torch.arange(ids.shape[1])[None]
    with torch.no_grad():
        out = hf(input_ids=ids, output_hidden_states=True)
        feats = torch.cat([out.hidden_states[i + 1] for i in module.layer_ids], dim=-1)
        fused = module.dflash.hidden_norm(module.dflash.fc(feats))
        extra = module.text_inputs(pos) if getattr(module, "extra_inputs", ()) else []
        ours = module(ids, pos, *extra, *module.empty_cache(ctx_len))
    tokens, context = ours[0], ours[2 if module.emit_logits else 1]
    checks = [Check("target", "vs-huggingface", "tokens", float((tokens != out.logits.argmax(-1)).float().mean()), 0.0)]
    d, tol = _diff("context_features", context.numpy(), fused.numpy())
    checks.append(Check("target", "vs-huggingface", "context_features", d, tol))
    if module.emit_logits:
        d, tol = _diff("logits", ours[1].numpy(), out.logits.numpy())
        checks.append(Check("target", "vs-huggingface", "logits", d, tol))
    return checks


def validate_export(
    src: Path, out: Path, shape, options, pair: dict, *, reduced: ReducedGraphs | None, progress
) -> tuple[list[Check], str]:
    """Check the exported graphs, or (`reduced`) the reduced model's graphs grown beside them.

    Returns the checks and the mode's description."""
    vision = []
    if (out / "vision.onnx").is_file():  # a vision-language target's tower, whole in either mode
        from dflash_cli.exporting.vision_graph import CHECK_COPY

        copy = out / CHECK_COPY  # a lean export's tower, weights included
        progress("validating the vision tower's graph against Hugging Face's")
        try:
            vision = vision_checks(src, (copy if copy.is_dir() else out) / "vision.onnx", options.dtype)
        finally:
            shutil.rmtree(copy, ignore_errors=True)
    if reduced is None:
        progress("validating the ONNX graphs against PyTorch and Hugging Face")
        checks = [c for g in GRAPHS for c in graph_checks(g, src, out / f"{g}.onnx", shape, options, pair)]
        return checks + vision, "full"
    plan = reduced.plan
    try:
        path = reduced.path
        if not reduced.made >= set(GRAPHS):
            why = "; ".join(f"{g}: {r}" for g, r in reduced.skipped.items()) or "a graph was traced whole"
            progress(f"tracing the reduced model itself ({why})")
            traced = out / TRACED_DIR
            traced.mkdir()
            _export_reduced(src, traced, shape, options, plan)
            path = lambda gname: traced / f"{gname}.onnx"  # noqa: E731
        progress(f"validating a {plan.layers}-layer, {plan.rows}-row reduced model grown from the same traced layers")
        checks = [c for g in GRAPHS for c in graph_checks(g, src, path(g), shape, options, pair, plan)]
        return checks + vision, plan.describe()
    finally:
        reduced.remove()


def _export_reduced(src: Path, where: Path, shape, options, plan: ReducedPlan) -> None:
    from dflash_cli.errors import DFlashError
    from dflash_cli.exporting.graphs import export_reduced

    try:
        export_reduced(src, where, shape, options, plan)
    except Exception as exc:  # reported with a hint of its own
        why = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        raise DFlashError(f"exporting the reduced model failed: {why}", hint="DFLASH_DEBUG=1 shows more") from exc


def graph_checks(
    gname: str, src: Path, onnx_path: Path, shape, options, pair: dict, plan: ReducedPlan | None = None
) -> list[Check]:
    """Every check of the graph `gname` ("target" or "draft") at `onnx_path`; the reduced model's graph
    when `plan` is given."""
    from dflash_cli.checkpoints.weights import WeightStore
    from dflash_cli.exporting import validation_calls as calls
    from dflash_cli.exporting.hf_reference import hf_model_holding
    from dflash_cli.modeling.layers import Rotary
    from dflash_cli.modeling.loading import (
        build_draft,
        build_target,
        computed_parts,
        draft_config,
        draft_store_name,
        fill_weights,
        target_config,
    )

    tcfg, dcfg = plan.configs(src) if plan is not None else (target_config(src), draft_config(src))
    ids, rows = (plan.ids, plan.rows) if plan is not None else (None, None)
    checks_pair: dict[str, Any] = dict(pair)
    if rows is not None:
        checks_pair["vocab_size"] = rows
        checks_pair["mask_token_id"] = min(pair["mask_token_id"], rows - 1)
    # One generator per graph: each graph's inputs do not depend on which graphs were checked before.
    rng = np.random.default_rng(GRAPHS.index(gname))
    B, P, C = shape.block, shape.prefill, shape.ctx_len
    if gname == "target":
        target = build_target(
            src, options.logits, cfg=tcfg, layer_ids=ids, device="meta", dtype=torch.float32, shape=shape
        )
        fill_weights(target, WeightStore.open(src / "target"), rows=rows)
        computed_parts(target, tcfg)
        checks = compare_graph(
            "target", onnx_path, target, calls.target_calls(rng, checks_pair, B, P), C, options.dtype
        )
        prompt = rng.integers(0, checks_pair["vocab_size"], size=(1, min(P, 32)), dtype=np.int64)
        return checks + target_vs_hf(hf_model_holding(tcfg, target), target, prompt, C)
    draft = build_draft(src, options.logits, cfg=dcfg, vocab=rows, device="meta", dtype=torch.float32)
    fill_weights(draft, WeightStore.open(src / "draft"), draft_store_name, rows=rows)
    draft.draft.rotary = Rotary(dcfg)
    return compare_graph("draft", onnx_path, draft, calls.draft_calls(rng, checks_pair, B, P), C, options.dtype)


def vision_checks(src: Path, onnx_path: Path, dtype: str = "fp32") -> list:
    """The exported tower against Hugging Face's own, on random pixels of hf_reference.CHECK_GRIDS (one call each)."""
    import numpy as np

    from dflash_cli.exporting.vision_graph import GRAPH, full_config, pooled_tower

    cfg = full_config(src)
    from dflash_cli.exporting.hf_reference import gemma4_tower_references, qwen3_vl_tower_references

    references = gemma4_tower_references if pooled_tower(cfg) else qwen3_vl_tower_references
    sess = _session(onnx_path)
    float_type = np.float16 if dtype == "fp16" else np.float32
    checks = []
    for label, feeds, wanted in references(src, cfg):
        feeds = {n: v.astype(float_type) if v.dtype == np.float32 else v for n, v in feeds.items()}
        for name, got in zip([o.name for o in sess.get_outputs()], sess.run(None, feeds)):
            d, tol = _diff(name, got, wanted[name], dtype)
            checks.append(Check(GRAPH, label, name, d, tol))
    return checks
