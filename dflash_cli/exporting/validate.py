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
        return checks + target_vs_hf(_hf_model(tcfg, target), target, prompt, C)
    draft = build_draft(src, options.logits, cfg=dcfg, vocab=rows, device="meta", dtype=torch.float32)
    fill_weights(draft, WeightStore.open(src / "draft"), draft_store_name, rows=rows)
    draft.draft.rotary = Rotary(dcfg)
    return compare_graph("draft", onnx_path, draft, calls.draft_calls(rng, checks_pair, B, P), C, options.dtype)


class _TextPathLM(torch.nn.Module):
    """Hugging Face's own language model of a multimodal family (Qwen3-VL's text model, which has no
    causal-LM class) under an lm_head: what the multimodal model computes on a text-only prompt."""

    def __init__(self, cfg) -> None:
        from transformers import AutoModel

        super().__init__()
        self.model = AutoModel.from_config(cfg, dtype=torch.float32)
        self.lm_head = torch.nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def forward(self, input_ids, output_hidden_states: bool = False):
        from types import SimpleNamespace

        out = self.model(input_ids=input_ids, output_hidden_states=output_hidden_states, use_cache=False)
        return SimpleNamespace(logits=self.lm_head(out.last_hidden_state), hidden_states=out.hidden_states)


def hf_text_lm(target_dir: Path):
    """Hugging Face's causal LM of an artifact's target (its text path), weights loaded, float32, eval."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from dflash_cli.checkpoints.weights import WeightStore

    cfg = AutoConfig.from_pretrained(str(target_dir))
    checkpoint_dtype = getattr(cfg, "dtype", None)
    try:
        model = AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=torch.float32).eval()
        _scale_embeddings_as_checkpoint(model, checkpoint_dtype)
        return model
    except ValueError:  # no causal-LM class (Qwen3-VL's text model): ours around theirs
        with torch.device("meta"):
            model = _TextPathLM(cfg)
        store = WeightStore.open(target_dir)
        state = {n: store.get(n, torch.float32) for n, _ in model.named_parameters()}
        model.load_state_dict(state, strict=True, assign=True)
        _fresh_rotary(model, cfg)
        return model.eval()


def _scale_embeddings_as_checkpoint(model, checkpoint_dtype) -> None:
    """Gemma 4's scaled embedding multiplies by sqrt(hidden) in the weights' dtype: running a bf16 checkpoint,
    Hugging Face uses bf16(sqrt(5376)) = 73.5, as our graphs do; a float32 model would use 73.32 and differ
    from both by 0.25%."""
    from dflash_cli.modeling.gemma4_target import embed_scale

    for module in model.modules():
        if hasattr(module, "scalar_embed_scale") and hasattr(module, "embed_scale"):
            module.embed_scale = torch.tensor(embed_scale(module.embedding_dim, checkpoint_dtype))


def _fresh_rotary(model, cfg) -> None:
    """Rotary tables are buffers computed at construction, not checkpoint weights: rebuild on the CPU the ones
    a model built on the meta device lacks."""
    for _, module in model.named_modules():
        meta = [n for n, b in module.named_buffers(recurse=False) if b.is_meta]
        if meta and any(n.endswith("inv_freq") for n in meta):  # one table, or one per layer kind (Gemma 4)
            with torch.device("cpu"):
                fresh = type(module)(config=cfg)
            for name in meta:
                setattr(module, name, getattr(fresh, name))
        elif meta == ["embed_scale"] and hasattr(module, "scalar_embed_scale"):  # Gemma 4's scaled embedding
            module.embed_scale = torch.tensor(module.scalar_embed_scale)  # _scale_embeddings_as_checkpoint sets it


def _causal_lm(cfg):
    from transformers import AutoModelForCausalLM

    try:
        return AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    except ValueError:  # no causal-LM class for this text config
        return _TextPathLM(cfg)


def _hf_model(cfg, target):
    """The Hugging Face model of `cfg`, holding the same tensors as our target module (no second copy)."""
    checkpoint_dtype = getattr(cfg, "dtype", None)  # building the model in float32 sets cfg.dtype to it
    with torch.device("meta"):
        hf = _causal_lm(cfg)
    from dflash_cli.modeling.moe import to_hf_state

    state = {k: v for k, v in target.state_dict().items() if not k.startswith(("dflash.", "rotary."))}
    state = to_hf_state(state, cfg)
    missing, unexpected = hf.load_state_dict(state, strict=False, assign=True)
    if getattr(cfg, "tie_word_embeddings", False):
        hf.lm_head.weight = hf.model.embed_tokens.weight
    _fresh_rotary(hf, cfg)
    _scale_embeddings_as_checkpoint(hf, checkpoint_dtype)
    leftover = [n for n, p in [*hf.named_parameters(), *hf.named_buffers()] if p.is_meta]
    if leftover:
        raise RuntimeError(f"Hugging Face model has unfilled tensors: {leftover[:5]}")
    return hf.eval()


# Two images' patch grids (t, h, w): a rectangle and a small square, each a whole number of merge units.
CHECK_GRIDS = ((1, 4, 6), (1, 2, 2))


def vision_checks(src: Path, onnx_path: Path, dtype: str = "fp32") -> list:
    """The exported tower against Hugging Face's own, on random pixels of CHECK_GRIDS (one call each)."""
    import numpy as np

    from dflash_cli.exporting.vision_graph import GRAPH, full_config, pooled_tower

    cfg = full_config(src)
    references = _gemma4_tower_references if pooled_tower(cfg) else _qwen3_vl_tower_references
    sess = _session(onnx_path)
    float_type = np.float16 if dtype == "fp16" else np.float32
    checks = []
    for label, feeds, wanted in references(src, cfg):
        feeds = {n: v.astype(float_type) if v.dtype == np.float32 else v for n, v in feeds.items()}
        for name, got in zip([o.name for o in sess.get_outputs()], sess.run(None, feeds)):
            d, tol = _diff(name, got, wanted[name], dtype)
            checks.append(Check(GRAPH, label, name, d, tol))
    return checks


def _hf_module(module_cls_or_config, store, rename, cfg=None):
    """A Hugging Face module built on the meta device, its parameters and buffers from the store."""
    from transformers import AutoModel

    with torch.device("meta"):
        if cfg is None:
            hf = AutoModel.from_config(module_cls_or_config, dtype=torch.float32)
        else:
            hf = module_cls_or_config(*cfg)
    names = [n for n, _ in [*hf.named_parameters(), *hf.named_buffers()] if rename(n) in store]
    hf.load_state_dict({n: store.get(rename(n), torch.float32) for n in names}, strict=False, assign=True)
    return hf.eval()


def _qwen3_vl_tower_references(src: Path, full_cfg):
    import numpy as np

    from dflash_cli.checkpoints.weights import WeightStore
    from dflash_cli.vision.images import tower_inputs

    cfg = full_cfg.vision_config
    hf = _hf_module(cfg, WeightStore.open(src / "target"), lambda n: "visual." + n)
    _fresh_rotary(hf, cfg)
    rng = np.random.default_rng(0)
    width = cfg.in_channels * cfg.temporal_patch_size * cfg.patch_size**2
    for grid in CHECK_GRIDS:
        pixels = rng.standard_normal((int(np.prod(grid)), width)).astype(np.float32)
        with torch.no_grad():
            ref = hf(torch.from_numpy(pixels), grid_thw=torch.tensor([grid]))
        wanted = {"vision_embeds": ref.pooler_output.numpy()}
        if getattr(ref, "deepstack_features", None):  # Qwen3.5's tower has none
            wanted["deepstack_embeds"] = torch.stack(ref.deepstack_features).numpy()
        yield "image {}x{}".format(*grid[1:]), tower_inputs(pixels, grid, cfg), wanted


def _gemma4_tower_references(src: Path, full_cfg):
    """Gemma 4: Hugging Face's tower then its multimodal embedder, on patch grids of pooling windows."""
    import numpy as np
    from transformers.models.gemma4.modeling_gemma4 import Gemma4MultimodalEmbedder

    from dflash_cli.checkpoints.weights import WeightStore
    from dflash_cli.modeling.vision_gemma4 import tower_inputs

    vcfg = full_cfg.vision_config
    store = WeightStore.open(src / "target")
    tower = _hf_module(vcfg, store, lambda n: "vision_tower." + n)
    _fresh_rotary(tower, vcfg)
    embedder = _hf_module(Gemma4MultimodalEmbedder, store, lambda n: "embed_vision." + n, (vcfg, full_cfg.text_config))
    k, width = vcfg.pooling_kernel_size, 3 * vcfg.patch_size**2
    rng = np.random.default_rng(0)
    for _, rows, cols in CHECK_GRIDS:  # patch rows and columns: whole pooling windows
        h, w = rows * k // 2, cols * k // 2
        positions = np.array([(x, y) for y in range(h) for x in range(w)], np.int64)
        pixels = rng.random((len(positions), width), dtype=np.float32)
        with torch.no_grad():
            pooled = tower(torch.from_numpy(pixels)[None], torch.from_numpy(positions)[None]).last_hidden_state
            ref = embedder(inputs_embeds=pooled)
        wanted = {"vision_embeds": ref.reshape(-1, ref.shape[-1]).numpy()}
        yield f"image {h}x{w} patches", tower_inputs(pixels, positions, full_cfg), wanted
