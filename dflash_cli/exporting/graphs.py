"""Trace the target and draft graphs on the meta device and stream their weights from the inject artifact.

`export_pair` writes target.onnx(+.data) and draft.onnx(+.data) into one directory, and with
`ExportOptions.prefix_graphs` their prefix-cache forms. The draft's embedding and lm_head are the
target's tensors, so draft.onnx references them inside target.onnx.data: one copy on disk. Each graph
is traced with one decoder layer and grown to its real depth (replicate.py); a graph replication does
not understand is traced whole instead. The reduced model of a large pair's validation (reduced.py)
is grown from the same traced layers, or exported here by `export_reduced` when it could not be.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from dflash_cli.checkpoints.weights import WeightStore
from dflash_cli.errors import CheckpointError
from dflash_cli.exporting import weight_sources
from dflash_cli.exporting.external_data import Initializer, WrittenTensors
from dflash_cli.exporting.options import ExportOptions, PairShape
from dflash_cli.exporting.replicate import LayerPlan, ReplicationError, grow_layers
from dflash_cli.exporting.torch_to_onnx import PENDING_ROWS_INPUTS, save_streamed, trace_template
from dflash_cli.exporting.write_progress import Throttled


def export_pair(
    src: Path, out: Path, shape: PairShape, options: ExportOptions, progress: Callable[[str], None], reduced=None
) -> dict[str, Any]:
    """Export the graphs; returns per-graph facts (io names, layers, heads, bytes written, seconds).

    `reduced` (reduced.ReducedGraphs): grows the reduced model's static graphs from the same traced
    layers, each after its real graph (`reduced.made` names the graphs it got)."""
    return _export_jobs(plan_jobs(src, shape, options), out, shape, options, progress, reduced)


def export_reduced(src: Path, out: Path, shape: PairShape, options: ExportOptions, plan) -> None:
    """The static graphs of the reduced model `plan` (reduced.ReducedPlan), each traced itself."""
    # The compile stage checks the prefix graphs against the real ones; validation runs these as they are.
    options = replace(options, prefix_graphs=False, lean=False)
    _export_jobs(plan_jobs(src, shape, options, plan), out, shape, options, lambda message: None, None)


def plan_jobs(src: Path, shape: PairShape, options: ExportOptions, reduced=None) -> list[_Job]:
    """The graphs to export, in order, as modules on the meta device: the pair's, or with `reduced`
    (a reduced.ReducedPlan) the reduced model's."""
    from dflash_cli.modeling.layers import Rotary
    from dflash_cli.modeling.loading import (
        build_draft,
        build_target,
        draft_config,
        draft_store_name,
        target_config,
        target_rotaries,
    )

    dtype, logits = options.torch_dtype, options.logits
    target_cfg, draft_cfg = reduced.configs(src) if reduced is not None else (target_config(src), draft_config(src))
    layer_ids, rows = (reduced.ids, reduced.rows) if reduced is not None else (None, None)
    target = build_target(src, logits, cfg=target_cfg, layer_ids=layer_ids, device="meta", dtype=dtype, shape=shape)
    draft = build_draft(src, logits, cfg=draft_cfg, vocab=rows, device="meta", dtype=dtype)
    jobs: list[_Job] = []
    target_symbolic = {"input_ids": 1, "position_ids": 1, **{n: 1 for n in getattr(target, "extra_inputs", ())}}
    for gname, module, store, rename, rope_cfg, sym in (
        ("target", target, WeightStore.open(src / "target"), None, target_cfg, target_symbolic),
        (
            "draft",
            draft,
            WeightStore.open(src / "draft"),
            draft_store_name,
            draft_cfg,
            {"context_features": 1, "context_position_ids": 1},
        ),
    ):
        prefix = "" if gname == "target" else "draft."
        sources = weight_initializers(module, store, rename, dtype, rows)
        rotaries = target_rotaries(module, rope_cfg) if gname == "target" else {"rotary": Rotary(rope_cfg)}
        tables = {}
        for rname, rotary in rotaries.items():
            sources[f"{prefix}{rname}.inv_freq"] = _constant(rotary.inv_freq.float())
            # RoPE by table lookup in the graph (fp16-safe angles); the tables cover every cache slot.
            tables[rname] = rotary.tables(shape.ctx_len)
            sources[f"{prefix}{rname}.cos_table"] = _constant(tables[rname][0])
            sources[f"{prefix}{rname}.sin_table"] = _constant(tables[rname][1])
        device = torch.device("meta")  # the bytes come from `sources`
        if hasattr(module, "mrope_axes"):  # M-RoPE (Qwen3-VL): which of t / h / w each rotary column follows
            from dflash_cli.modeling.vl_target import mrope_axes_of

            sources["mrope_axes"] = _constant(mrope_axes_of(rope_cfg, module.spec.head_dim))
        stand_in = _one_layer_stand_in(gname, module, rope_cfg, src, options, rows)
        for traced in (module, stand_in):
            if traced is not None:
                _keep_rope_float32(traced)
                for rname, (cos, sin) in tables.items():
                    getattr(traced if gname == "target" else traced.draft, rname).use_tables(
                        cos.to(device), sin.to(device)
                    )
        # "_prefix": the same module traced in its prefix-cache form for ONNX Runtime (see
        # StaticCacheTarget.use_prefix_cache); `written` makes it point at the weights already written.
        # "_cb": the static form with a cache of several sequences (modeling/slot_cache.py), for QAIC.
        flavours = ("", "_prefix") if options.prefix_graphs else ("",)
        for flavour in flavours + (("_cb",) if options.full_batch_size > 1 else ()):
            jobs.append(_Job(gname, flavour, module, stand_in, store, rename, sources, sym))
    if reduced is None and getattr(target, "extra_inputs", ()):  # a vision-language target: its tower too
        from dflash_cli.exporting import vision_graph

        tower = vision_graph.build_vision(src, dtype=dtype)
        _keep_rope_float32(tower)  # its rotary frequencies stay float32 in an fp16 export, as the language graphs'
        store, rename = WeightStore.open(src / "target"), vision_graph.store_name(src)
        sources = weight_initializers(tower, store, rename, dtype, None)
        sources["inv_freq"] = _constant(vision_graph.inv_freq(src))
        ins, _ = tower.io_names()
        jobs.append(_Job(vision_graph.GRAPH, "", tower, None, store, rename, sources, dict.fromkeys(ins, 0)))
    return jobs


def _export_jobs(
    jobs: list[_Job], out: Path, shape: PairShape, options: ExportOptions, progress, reduced
) -> dict[str, Any]:
    """Trace and write each job's graph, in order; returns export_pair's per-graph facts."""
    written = WrittenTensors()  # tensors a later graph references instead of writing again
    graphs: dict[str, Any] = {}
    origins: dict[str, dict] = {}  # onnx file -> {initializer: checkpoint tensor}, for the compile
    for job in jobs:
        t0 = time.perf_counter()
        name = job.gname + job.flavour
        report = Throttled(progress, name)
        path = out / f"{name}.onnx"
        nbytes = None
        if job.stand_in is not None:
            # One layer traced, copied to the real depth (replicate.py): minutes -> seconds.
            model, by_graph_name = _trace(job, shape, options)
            template = model.clone() if reduced is not None and not job.flavour else None
            try:
                grow_layers(model, layer_plan(job.gname, job.module), job.sources, by_graph_name)
                nbytes = save_streamed(model, path, by_graph_name, written, report, defer=options.lean)
            except ReplicationError as exc:
                progress(f"{name}.onnx: tracing every layer ({exc})")
            if template is not None:  # after the real graph: its layers' tensors are then in `written`
                reduced.grow(job.gname, template, job.store, job.rename, written)
        if nbytes is None:
            model, by_graph_name = _trace(replace(job, stand_in=None), shape, options)
            nbytes = save_streamed(model, path, by_graph_name, written, report, defer=options.lean)
            if options.lean and job.gname == "vision" and options.validation != "off":
                # A lean tower has no weights to run: validation runs a copy that has them (then deleted).
                from dflash_cli.exporting.vision_graph import CHECK_COPY

                copy, copy_sources = _trace(replace(job, stand_in=None), shape, options)
                (out / CHECK_COPY).mkdir()
                save_streamed(copy, out / CHECK_COPY / path.name, copy_sources, WrittenTensors(), digest=False)
        origins[path.name] = {n: src.origin for n, src in by_graph_name.items() if src.origin is not None}
        graphs[name] = {
            **graph_facts(job.gname, job.module, shape, job.flavour),
            "data_bytes": nbytes,
            "seconds": round(time.perf_counter() - t0, 2),
        }
    for job in jobs:
        job.module.use_prefix_cache(False)
        if hasattr(job.module, "use_batch_index"):
            job.module.use_batch_index(0)
        job.store.close()
    weight_sources.write(out, origins)
    return graphs


@dataclass
class _Job:
    """One graph to export: `module` at its real depth, traced as `stand_in` (one layer) when given."""

    gname: str
    flavour: str  # "" (static cache) or "_prefix"
    module: Any
    stand_in: Any
    store: WeightStore
    rename: Any
    sources: dict[str, Initializer]
    sym: dict[str, int]


def _trace(job: _Job, shape: PairShape, options: ExportOptions):
    slots = options.full_batch_size if job.flavour == "_cb" else 0
    for m in (job.module, job.stand_in):
        if m is not None:
            m.use_prefix_cache(job.flavour == "_prefix")
            if hasattr(m, "use_batch_index"):
                m.use_batch_index(slots)
    traced = job.stand_in if job.stand_in is not None else job.module
    ins, outs = traced.io_names()
    if job.gname == "vision":
        from dflash_cli.exporting.vision_graph import example_inputs

        example = example_inputs(traced, options.torch_dtype)
        return trace_template(traced, example, ins, outs, job.sym, job.sources, options.opset, moe_ops=options.moe_ops)
    prefix_cache = job.flavour == "_prefix"
    # A prefix graph of a module that allows it takes several sequences per call (continuous batching)
    batched = prefix_cache and getattr(traced, "batched_prefix", False)
    example = _example_inputs(job.gname, traced, shape, options.torch_dtype, prefix_cache, 2 if batched else 1, slots)
    # The prefix form's symbolic cache inputs: K/V's filled slots, and a hybrid target's pending rows.
    past = tuple(n for n in ins if n.startswith(("past_key.", "past_value."))) if prefix_cache else ()
    rows = tuple(n for n in ins if n.startswith(PENDING_ROWS_INPUTS)) if prefix_cache else ()
    batch = tuple(ins) if batched else ()
    if slots:  # a call carries any number of the cache's sequences; the cache itself has all of them
        batch = tuple(n for n in ins if not n.startswith("past_"))
    # A DFlash draft's prefix graph drafts as many rows as it is handed (a DFlash2 draft's convolutions span a
    # fixed block): `dflash bench` times shorter drafts from one build (what a smaller dflash.block_size costs).
    block = ("input_ids", "position_ids") if prefix_cache and getattr(traced, "any_block_rows", False) else ()
    return trace_template(
        traced, example, ins, outs, job.sym, job.sources, options.opset, past, rows, batch, block, options.moe_ops
    )


def _one_layer_stand_in(gname, module, hf_config, src: Path, options: ExportOptions, rows):
    """The model with one decoder layer (same names, shapes and options), or None when the model has
    a single layer anyway."""
    import copy

    from dflash_cli.modeling.loading import build_draft, build_target

    depth = module.spec.num_layers if gname == "target" else len(module.draft.layers)
    if depth < 2 or (gname == "target" and _mixed_layers(module)):  # layers of two kinds: replicate.py grows one
        return None
    cfg = copy.deepcopy(hf_config)
    cfg.num_hidden_layers = 1
    dtype = options.torch_dtype
    if gname == "draft":
        return build_draft(src, options.logits, cfg=cfg, vocab=rows, device="meta", dtype=dtype)
    ids = [-1 if i == depth - 1 else 0 for i in module.layer_ids]
    stand_in = build_target(src, options.logits, cfg=cfg, layer_ids=ids, device="meta", dtype=dtype)
    stand_in.normed_tap = -1
    return stand_in


def _mixed_layers(module) -> bool:
    """A hybrid target (linear and full attention), a MoE target with some dense MLP layers, or windows that differ."""
    from dflash_cli.modeling.hybrid_target import HybridCacheTarget

    if getattr(module, "deepstack", 0):  # a vision-language target: image features join its first layers only
        return True
    if not getattr(module, "uniform_layers", True):  # layers of several shapes (Gemma 4's global layers)
        return True
    sparse = len(getattr(module.spec, "sparse_layers", ()))
    # gpt-oss: sliding-window and full layers alternate; replication grows them from a sliding layer 0
    windows = list(getattr(module.spec, "windows", ()) or ())
    mixed_windows = windows and (windows[0] is None or len(set(windows) - {None}) > 1)
    return isinstance(module, HybridCacheTarget) or 0 < sparse < module.spec.num_layers or bool(mixed_windows)


def layer_plan(gname: str, module) -> LayerPlan:
    """How replicate.py grows `module`'s one-layer graph to its depth."""
    ins, outs = module.io_names()
    full: frozenset[int] = frozenset()
    if gname == "target":
        n, where, taps = module.spec.num_layers, "model.", tuple(module.layer_ids)
        windows = getattr(module.spec, "windows", ()) or ()
        full = frozenset(i for i, w in enumerate(windows) if w is None)
    else:
        n, where, taps = len(module.draft.layers), "draft.", ()
    names = where + "layers.", where + "embed_tokens", where + "norm"
    return LayerPlan(n, *names, tuple(ins), tuple(outs), taps, full)


def graph_facts(gname: str, module, shape: PairShape, flavour: str = "") -> dict[str, Any]:
    """What export.json records of one graph (io names, cache geometry, the seq_len of each call kind)."""
    if gname == "vision":
        from dflash_cli.exporting.vision_graph import facts

        return facts(module)
    ins, outs = module.io_names()
    spec = module.spec if gname == "target" else None
    windows = list(getattr(spec, "windows", ()) or ())  # gpt-oss sliding-window layers: the compile fuses with them
    return {
        **({"attention_windows": windows} if windows else {}),
        "onnx": f"{gname}{flavour}.onnx",
        "cache": {"": "static", "_prefix": "prefix", "_cb": "slots"}[flavour],
        **({"full_batch_size": module.full_batch_size} if flavour == "_cb" else {}),
        "inputs": ins,
        "outputs": outs,
        "num_layers": spec.num_layers if spec else len(module.draft.layers),
        "num_kv_heads": spec.kv_heads if spec else module.draft.kv_heads,
        "head_dim": spec.head_dim if spec else module.draft.head_dim,
        "seq_lens": {"prefill": shape.prefill, "verify": shape.block, "decode": 1}
        if gname == "target"
        else {"prefill": shape.prefill, "decode": shape.block},
    }


def example_inputs_real(gname: str, module, shape: PairShape) -> tuple:
    """CPU example inputs for the TorchScript exporter (float32 only)."""
    B, P = shape.block, shape.prefill
    past = module.empty_cache(shape.ctx_len)
    if gname == "target":
        return (torch.zeros(1, B, dtype=torch.long), torch.arange(B)[None], *past)
    return (
        torch.zeros(1, B, dtype=torch.long),
        torch.arange(P, P + B)[None],
        torch.zeros(1, P, shape.hidden),
        torch.arange(P)[None],
        *past,
    )


def _keep_rope_float32(module: torch.nn.Module) -> None:
    for m in module.modules():
        if hasattr(m, "inv_freq") and m.inv_freq.dtype != torch.float32:
            m.inv_freq = m.inv_freq.float()


def weight_initializers(
    module, store: WeightStore, rename, dtype: torch.dtype, rows: int | None
) -> dict[str, Initializer]:
    """Each parameter of `module` as an Initializer reading its checkpoint tensor converted to `dtype`; with
    `rows` (the reduced model) a tensor the module has fewer rows of is cut to them."""
    out = {}
    for name, param in module.named_parameters():
        key = rename(name) if rename else name
        # the reduced model's cut tensors: vocabulary rows, and a MoE layer's first experts
        cut = param.shape[0] if rows is not None and store.shape(key)[:1] != tuple(param.shape[:1]) else None
        if key in store.stacks:  # assembled from several checkpoint tensors, one slab at a time
            identity = ("stack", str(store.root.resolve()), key, str(dtype), cut)  # the prefix graph shares it
            where = weight_sources.stack_origin(store, key, str(dtype).removeprefix("torch."), cut)
            out[name] = Initializer(name, identity, _reader(store, key, dtype, cut, tuple(param.shape)), where)
            continue
        ref = store.refs.get(key)
        if ref is None:  # a truncated or partial checkpoint
            raise CheckpointError(f"the checkpoint in {store.root} has no tensor {key}", hint="download it again")
        st = os.stat(store.root / ref.file)
        identity = (st.st_dev, st.st_ino, ref.key, str(dtype), cut)
        where = weight_sources.origin(store.root / ref.file, ref.key, str(dtype).removeprefix("torch."), cut)
        out[name] = Initializer(name, identity, _reader(store, key, dtype, cut, tuple(param.shape)), where)
    return out


def _reader(store: WeightStore, key: str, dtype: torch.dtype, cut: int | None, shape: tuple[int, ...]):
    def produce():
        ref_shape = store.shape(key)
        want = ((cut,) + tuple(ref_shape[1:])) if cut is not None else tuple(ref_shape)
        if want != shape:
            from dflash_cli.errors import CheckpointError

            raise CheckpointError(
                f"tensor {key} has shape {list(ref_shape)}, the graph expects {list(shape)}",
                hint="rebuild from a clean cache: `dflash build --force`",
            )
        for block in store.iter_rows(key, dtype, rows=cut):
            yield block.contiguous().numpy()
        store.close()  # unmap the file: pages read so far would otherwise stay in this process's RSS

    return produce


def _constant(t: torch.Tensor) -> Initializer:
    data = t.numpy()
    return Initializer("constant", None, lambda: iter([data]))


def _example_inputs(
    gname: str, module, shape: PairShape, dtype: torch.dtype, prefix_cache: bool = False, batch: int = 1, slots: int = 0
) -> tuple:
    """`batch` 2 (not 1, which the exporter would fix as a constant) traces a symbolic batch axis; `slots`: the
    sequences a "_cb" graph's cache holds (its calls then carry 2 of them, and `batch_index`)."""
    B, P = shape.block, shape.prefill
    meta = torch.device("meta")
    from dflash_cli.modeling.hybrid_target import HybridCacheTarget

    if isinstance(module, HybridCacheTarget):  # its cache inputs are of several kinds: the module knows their shapes
        # prefix form: filled slots and pending rows of example sizes unlike any other, so they stay symbolic
        past = (
            module.empty_cache(P + 3, dtype=dtype, device=meta, rows=B + 5)
            if prefix_cache
            else module.empty_cache(shape.ctx_len, dtype=dtype, device=meta)
        )
    elif prefix_cache:  # [b, L, kvh, d] with an example L unlike any other size, so it stays symbolic
        past = [
            torch.empty((batch, P + 3, p.shape[1], p.shape[3]), dtype=dtype, device=meta) for p in module.empty_cache(1)
        ]
    else:
        past = [
            torch.empty(
                (slots or p.shape[0],) + p.shape[1:2] + (shape.ctx_len,) + p.shape[3:], dtype=dtype, device=meta
            )
            for p in module.empty_cache(1)
        ]
    batch = 2 if slots else batch
    index = [torch.zeros(batch, 1, dtype=torch.long, device=meta)] if slots else []
    ids = torch.zeros(batch, B, dtype=torch.long, device=meta)
    if gname == "target":
        pos = torch.zeros(batch, B, dtype=torch.long)
        extra = [t.to(meta) for t in module.text_inputs(pos, dtype)] if getattr(module, "extra_inputs", ()) else []
        return (ids, pos.to(meta), *index, *extra, *past)
    long = {"dtype": torch.long, "device": meta}
    # `proposal_rows`: how many proposals reach the head, an example count unlike any other size (stays symbolic)
    rows = [torch.zeros(batch, B + P + 7, **long)] if getattr(module, "takes_proposal_rows", False) else []
    ctx = torch.zeros(batch, P, shape.hidden, dtype=dtype, device=meta)
    return (ids, torch.zeros(batch, B, **long), ctx, torch.zeros(batch, P, **long), *index, *rows, *past)
