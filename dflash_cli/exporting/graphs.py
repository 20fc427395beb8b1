"""Trace the target and draft graphs on the meta device and stream their weights from the inject artifact.

`export_pair` writes target.onnx(+.data) and draft.onnx(+.data) into one directory. The draft's
embedding and lm_head are the target's tensors, so draft.onnx references them inside
target.onnx.data: one copy on disk. `rows` (a reduced vocabulary) and the configs passed in let the
validation twin go through exactly the same code.
"""

from __future__ import annotations

import gc
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from dflash_cli.exporting import trace_worker, weight_sources
from dflash_cli.exporting.external_data import DataFile, Initializer, WrittenTensors, prewrite
from dflash_cli.exporting.replicate import ReplicationError
from dflash_cli.exporting.template_arrivals import TemplateArrivals
from dflash_cli.exporting.torch_to_onnx import finish_template, trace_template
from dflash_cli.exporting.trace_worker import TraceWorker
from dflash_cli.weights import WeightStore

DTYPES = {"fp32": torch.float32, "fp16": torch.float16}


@dataclass(frozen=True)
class PairShape:
    block: int
    prefill: int
    ctx_len: int
    hidden: int


def export_pair(
    src: Path,
    out: Path,
    shape: PairShape,
    *,
    dtype: torch.dtype,
    logits: bool,
    opset: int,
    progress: Callable[[str], None],
    target_cfg=None,
    draft_cfg=None,
    layer_ids: list[int] | None = None,
    rows: int | None = None,
    prefix_graphs: bool = True,
    twin=None,
    direct: bool = True,
    early=None,
) -> dict[str, Any]:
    """Export both graphs; returns per-graph facts (io names, layers, heads, bytes written, seconds).

    With `prefix_graphs`, also `target_prefix.onnx` / `draft_prefix.onnx`: the same models in the
    prefix-cache form ONNX Runtime runs (cost in proportion to the filled cache, no cache copy), whose
    weights are the ones target.onnx.data / draft.onnx.data already hold. With `twin`
    (twin_graphs.TwinGraphs), the validation twin's static graphs are grown from the same traced
    layers (`twin.made` names the graphs it got; the caller exports the rest itself). `direct`: the
    data files may bypass the page cache (DFLASH_DIRECT_IO=1; dflash_cli/direct_file.py); False when
    something reads them back at once. `early` (early_trace.EarlyTrace): graphs traced ahead of this
    stage, used when they were traced from exactly these configs and settings.
    """
    jobs = plan_jobs(
        src,
        shape,
        dtype=dtype,
        logits=logits,
        target_cfg=target_cfg,
        draft_cfg=draft_cfg,
        layer_ids=layer_ids,
        rows=rows,
        prefix_graphs=prefix_graphs,
    )
    ahead = None
    if early is not None and (target_cfg, draft_cfg, layer_ids, rows) == (None, None, None, None):
        ahead = early.worker_for(src, shape, dtype, logits, opset, prefix_graphs)
    return _export_jobs(jobs, out, shape, dtype, opset, progress, twin, direct, ahead)


def plan_jobs(
    src: Path,
    shape: PairShape,
    *,
    dtype: torch.dtype,
    logits: bool,
    target_cfg=None,
    draft_cfg=None,
    layer_ids: list[int] | None = None,
    rows: int | None = None,
    prefix_graphs: bool = True,
    weights: bool = True,
) -> list[_Job]:
    """The graphs export_pair writes, in order, as modules on the meta device. `weights=False` needs
    only the configs and pair.json in `src` (the early tracer): the jobs can be traced, not written."""
    from dflash_cli.modeling.layers import Rotary
    from dflash_cli.modeling.loading import build_draft, build_target, draft_config, draft_store_name, target_config

    target_cfg = target_cfg or target_config(src)
    draft_cfg = draft_cfg or draft_config(src)
    target = build_target(src, logits, cfg=target_cfg, layer_ids=layer_ids, device="meta", dtype=dtype)
    draft = build_draft(src, logits, cfg=draft_cfg, vocab=rows, device="meta", dtype=dtype)
    jobs: list[_Job] = []
    for gname, module, store, rename, rope_cfg, sym in (
        ("target", target, _store(src / "target", weights), None, target_cfg, {"input_ids": 1, "position_ids": 1}),
        (
            "draft",
            draft,
            _store(src / "draft", weights),
            draft_store_name,
            draft_cfg,
            {"context_features": 1, "context_position_ids": 1},
        ),
    ):
        prefix = "" if gname == "target" else "draft."
        sources = _sources(module, store, rename, dtype, rows) if weights else _unread(module)
        rotary = Rotary(rope_cfg)
        sources[prefix + "rotary.inv_freq"] = _constant(rotary.inv_freq.float())
        # RoPE by table lookup in the graph (fp16-safe angles); the tables cover every cache slot.
        cos, sin = rotary.tables(shape.ctx_len)
        device = torch.device("meta")  # the bytes come from `sources`
        sources[prefix + "rotary.cos_table"] = _constant(cos)
        sources[prefix + "rotary.sin_table"] = _constant(sin)
        stand_in = _one_layer_stand_in(gname, module, rope_cfg, src, logits, dtype, rows)
        for traced in (module, stand_in):
            if traced is not None:
                _keep_rope_float32(traced)
                rot = traced.rotary if gname == "target" else traced.draft.rotary
                rot.use_tables(cos.to(device), sin.to(device))
        # "_prefix": the same module traced in its prefix-cache form for ONNX Runtime (see
        # StaticCacheTarget.use_prefix_cache); `written` makes it point at the weights already written.
        for flavour in ("", "_prefix") if prefix_graphs else ("",):
            jobs.append(_Job(gname, flavour, module, stand_in, store, rename, sources, sym))
    return jobs


def _export_jobs(
    jobs: list[_Job], out: Path, shape: PairShape, dtype, opset: int, progress, twin, direct: bool, ahead=None
) -> dict[str, Any]:
    """Trace and write each job's graph, in order; returns export_pair's per-graph facts."""
    written = WrittenTensors()
    graphs: dict[str, Any] = {}

    def trace(job: _Job):
        return _trace(job, shape, dtype, opset)

    # The first graph (the target's) holds most of the bytes. Its weights are written before anything
    # else, in the module's parameter order, while its template is traced elsewhere: by the early
    # tracer, started before convert (early_trace.py), or by a child forked here; either traces every
    # graph, in order (trace_worker.py). Where neither can, this process traces after writing. The
    # file's layout is the same whoever traced what.
    worker = ahead
    if worker is None and trace_worker.usable():
        # Out of the cyclic collector's full scans from here on, in both processes (and no GC writes
        # to their pages in the child): mostly imported modules, which live as long as the process;
        # this export's modules and jobs, also frozen, are freed by reference counting.
        gc.freeze()
        try:
            worker = TraceWorker(jobs, trace)
        except (OSError, AssertionError):  # no process to spare (limits; a daemon process may not fork)
            worker = None
    origins: dict[str, dict] = {}  # onnx file -> {initializer: checkpoint tensor}, for the compile

    def twin_hook(job: _Job):
        if twin is None or job.flavour or job.stand_in is None:
            return None
        return twin.hook(job.gname, WeightStore.open(job.store.root), job.rename)  # its own file handles

    arrivals = None
    if worker is not None:
        hooks = {i: hook for i, job in enumerate(jobs) if (hook := twin_hook(job)) is not None}
        arrivals = TemplateArrivals(worker, jobs, hooks)
    first = jobs[0]
    data = DataFile(out, f"{first.gname}{first.flavour}.onnx.data", direct=direct)
    try:
        ahead_of = [(first.sources[n], p.numel() * p.element_size()) for n, p in first.module.named_parameters()]
        prewrite(data, ahead_of, written, _Throttled(progress, first.gname + first.flavour, what="weight"))
        for i, job in enumerate(jobs):
            t0 = time.perf_counter()
            got, hooked = arrivals.get(i) if arrivals is not None else (None, False)
            if got is None:
                model, by_graph_name = trace(job)
                traced_s = time.perf_counter() - t0
                traced_by = "this process"
            else:
                model, by_graph_name, traced_s = got
                _set_flavour(job)
                traced_by = "early tracer" if ahead is not None else "forked tracer"
            t1 = time.perf_counter()
            name = job.gname + job.flavour
            report = _Throttled(progress, name)
            path = out / f"{name}.onnx"
            job_data = data if i == 0 else None
            nbytes = None
            if job.stand_in is not None:
                # One layer traced, copied to the real depth (exporting/replicate.py): minutes -> seconds.
                ins, outs = job.module.io_names()
                plan = _layer_plan(job.gname, job.module, ins, outs)
                hook = None if hooked else twin_hook(job)
                try:
                    nbytes = finish_template(
                        model, by_graph_name, path, job.sources, written, report, plan, hook, direct, job_data
                    )
                except ReplicationError as exc:
                    progress(f"{name}.onnx: tracing every layer ({exc})")
            if nbytes is None:
                model, by_graph_name = trace(replace(job, stand_in=None))
                nbytes = finish_template(
                    model, by_graph_name, path, job.sources, written, report, direct=direct, data=job_data
                )
            origins[path.name] = {n: src.origin for n, src in by_graph_name.items() if src.origin is not None}
            graphs[name] = {
                **graph_facts(job.gname, job.module, shape, job.flavour),
                "data_bytes": nbytes,
                "seconds": round(traced_s + time.perf_counter() - t1, 2),
                "traced_by": traced_by,
            }
    finally:
        data.close(ok=False)  # a no-op once the first graph is written
        if worker is not None:
            worker.close()
    for job in jobs:
        job.module.use_prefix_cache(False)
        if job.store is not None:
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
    store: WeightStore | None  # None when planned without weights (plan_jobs)
    rename: Any
    sources: dict[str, Initializer]
    sym: dict[str, int]


def _set_flavour(job: _Job) -> None:
    for m in (job.module, job.stand_in):
        if m is not None:
            m.use_prefix_cache(job.flavour == "_prefix")


def _trace(job: _Job, shape: PairShape, dtype, opset: int):
    _set_flavour(job)
    traced = job.stand_in if job.stand_in is not None else job.module
    ins, outs = traced.io_names()
    prefix_cache = job.flavour == "_prefix"
    example = _example_inputs(job.gname, traced, shape, dtype, prefix_cache=prefix_cache)
    past = tuple(n for n in ins if n.startswith("past_")) if prefix_cache else ()
    return trace_template(traced, example, ins, outs, job.sym, job.sources, opset, past)


def _one_layer_stand_in(gname, module, hf_config, src: Path, logits: bool, dtype, rows):
    """The model with one decoder layer (same names, shapes and options), or None when replication is
    off (DFLASH_EXPORT_REPLICATE=0) or the model has a single layer anyway."""
    import copy

    from dflash_cli.modeling.loading import build_draft, build_target

    depth = module.spec.num_layers if gname == "target" else len(module.draft.layers)
    if os.environ.get("DFLASH_EXPORT_REPLICATE", "1") == "0" or depth < 2:
        return None
    cfg = copy.deepcopy(hf_config)
    cfg.num_hidden_layers = 1
    if gname == "draft":
        return build_draft(src, logits, cfg=cfg, vocab=rows, device="meta", dtype=dtype)
    ids = [-1 if i == depth - 1 else 0 for i in module.layer_ids]
    stand_in = build_target(src, logits, cfg=cfg, layer_ids=ids, device="meta", dtype=dtype)
    stand_in.normed_tap = -1
    return stand_in


def _layer_plan(gname: str, module, ins: list[str], outs: list[str]):
    from dflash_cli.exporting.replicate import LayerPlan

    if gname == "target":
        n, where, taps = module.spec.num_layers, "model.", tuple(module.layer_ids)
    else:
        n, where, taps = len(module.draft.layers), "draft.", ()
    return LayerPlan(n, where + "layers.", where + "embed_tokens", where + "norm", tuple(ins), tuple(outs), taps)


def graph_facts(gname: str, module, shape: PairShape, flavour: str = "") -> dict[str, Any]:
    """What export.json records of one graph (io names, cache geometry, the seq_len of each call kind)."""
    ins, outs = module.io_names()
    spec = module.spec if gname == "target" else None
    return {
        "onnx": f"{gname}{flavour}.onnx",
        "cache": "prefix" if flavour else "static",
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


def _sources(module, store: WeightStore, rename, dtype: torch.dtype, rows: int | None) -> dict[str, Initializer]:
    out = {}
    for name, param in module.named_parameters():
        key = rename(name) if rename else name
        ref = store.refs[key]
        st = os.stat(store.root / ref.file)
        cut = rows if rows is not None and ref.shape[0] != param.shape[0] else None
        identity = (st.st_dev, st.st_ino, ref.key, str(dtype), cut)
        where = weight_sources.origin(store.root / ref.file, ref.key, str(dtype).removeprefix("torch."), cut)
        out[name] = Initializer(name, identity, _reader(store, key, dtype, cut, tuple(param.shape)), where)
    return out


def _store(root: Path, weights: bool) -> WeightStore | None:
    return WeightStore.open(root) if weights else None


def _unread(module) -> dict[str, Initializer]:
    """Stand-ins for `module`'s weights that name them only: enough to trace, never written.

    Tracing reads no weight bytes except where onnxscript's rewriter compares a constant with a
    pattern's scalar (or short list) constant: a vector weight never matches a scalar, and a value it
    cannot read (FileNotFoundError) fails the match the same way, so the graph comes out as with
    the real bytes. A weight of one element could match: reading one fails the trace instead (the
    export then traces the graph itself)."""

    def unavailable(name: str, numel: int):
        def produce():
            if numel < 2:
                raise RuntimeError(f"{name}: a one-element weight would be compared by value")
            raise FileNotFoundError(f"{name}: traced without weights")

        return produce

    return {
        name: Initializer(name, None, unavailable(name, param.numel())) for name, param in module.named_parameters()
    }


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


def _example_inputs(gname: str, module, shape: PairShape, dtype: torch.dtype, prefix_cache: bool = False) -> tuple:
    B, P = shape.block, shape.prefill
    meta = torch.device("meta")
    if prefix_cache:  # [1, L, kvh, d] with an example L unlike any other size, so it stays symbolic
        past = [
            torch.empty((1, P + 3, p.shape[1], p.shape[3]), dtype=dtype, device=meta) for p in module.empty_cache(1)
        ]
    else:
        past = [
            torch.empty(p.shape[:2] + (shape.ctx_len,) + p.shape[3:], dtype=dtype, device=meta)
            for p in module.empty_cache(1)
        ]
    ids = torch.zeros(1, B, dtype=torch.long, device=meta)
    if gname == "target":
        return (ids, torch.zeros(1, B, dtype=torch.long, device=meta), *past)
    return (
        ids,
        torch.zeros(1, B, dtype=torch.long, device=meta),
        torch.zeros(1, P, shape.hidden, dtype=dtype, device=meta),
        torch.zeros(1, P, dtype=torch.long, device=meta),
        *past,
    )


class _Throttled:
    """Progress lines at most every few seconds: tensor k of n (`what`) and bytes written."""

    def __init__(self, progress: Callable[[str], None], gname: str, every_s: float = 3.0, what: str = "tensor") -> None:
        self.progress, self.gname, self.every_s, self.what = progress, gname, every_s, what
        self.last = 0.0

    def __call__(self, done: int, total: int, nbytes: int) -> None:
        now = time.monotonic()
        if done == total or now - self.last >= self.every_s:
            self.last = now
            self.progress(f"{self.gname}.onnx: {self.what} {done}/{total}, {nbytes / 1e9:.2f} GB written")
