"""The prefix-cache target's attention -> ONNX Runtime's GroupQueryAttention, KV cache updated in place.

The exported prefix-cache target (exporting/graphs.py, `target_prefix.onnx`) spells attention out:
RoPE as Slice/Neg/Concat/Mul/Add, the past concatenated with the call's K/V, a mask built from
position_ids, scores, Where, Softmax, a second MatMul, and the call's K/V returned for the host to
store: ~70 nodes per layer, each with ONNX Runtime's per-node cost (most of a decode step's time
after the weights' MatMuls on a 0.6B model). This rewrite replaces them per layer with one
GroupQueryAttention node (com.microsoft; RoPE inside, do_rotary=1) whose past and present share one
buffer per layer, [1, kv_heads, ctx_len, head_dim]: the kernel writes the call's K/V at its slots and
attends over the filled ones, so nothing is concatenated or copied and the host stores nothing
(backends/ort_kv_inplace.py owns the buffers).

What it relies on, all checked or anchored by name rather than by op patterns (ortcompile/gqa_match.py finds
the projections):
  * layer i's projections are the MatMuls of initializers named `...layers.i.self_attn.{q,k,v,o}_proj.weight`
    (plain, transposed, MatMulNBits' `.w4` / `.w8`, or one stacked q/k/v MatMulNBits and its Split that
    names its parts, ortcompile/quantize.py); q/k go through one fused q_norm/k_norm
    (SimplifiedLayerNormalization, after fuse.py) or none (Llama);
  * one pair of RoPE tables `*rotary.cos_table` / `*rotary.sin_table` [ctx_len, head_dim] repeating their
    halves (rotate-half RoPE, as Qwen3 and Llama use; not Gemma 4's per-layer-kind ones, heads of two widths);
  * calls are contiguous: each sequence's real rows sit at positions start, start+1, ... with padding
    after them (the session checks it). GroupQueryAttention takes positions from each sequence's cache
    length, so position_ids[:, 0] only gives the starts (a batched call: one per sequence).
  * what ONNX Runtime's kernel accepts (`kernel_refusal`): with RoPE inside (do_rotary=1) head_dim a
    multiple of 16, and num_heads a multiple of kv_heads; checked before anything is rewritten.
Anything else leaves the graph as it was, with the reason. The compile stage then checks the result
against the exported graph on the same calls and for causal invariance, as every rewrite.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from dflash_cli.ortcompile.gqa_match import GraphIndex, Projections, find_projections, normed_heads, with_bias

KV_LAYOUT_KEY = "dflash.kv_cache"
KV_IN_PLACE = "in_place_bnsh"  # past_* / present_* share [b, kv_heads, ctx_len + SPARE_SLOTS, head_dim] buffers
SPARE_SLOTS = 1  # for the padding row of a one-token call at the last slot (one-token calls attend as two rows)
_SINKS = re.compile(r"layers\.(\d+)\.self_attn\.sinks$")  # gpt-oss's per-head sink logits
# ONNX Runtime's GroupQueryAttention (CPU, 1.32) checks its inputs at the first run, not at session creation:
# with cos/sin caches (do_rotary=1, as here) head_size % 16 == 0 (CheckRotaryCaches: 16, 32, ..., 128, 256 run;
# 8, 24, 40, 72 are refused), without them head_size % 8 == 0; always num_heads % kv_num_heads == 0.
ROTARY_HEAD_DIM_MULTIPLE = 16


@dataclass
class GqaResult:
    layers: int = 0
    merged_pads: int = 0  # layers whose q/k/v are padded once, before the Split of their stacked projection
    skipped: list[str] = field(default_factory=list)  # why the graph (or a layer) was left as it was


def kernel_refusal(head_dim: int, heads: int | None = None, kv_heads: int | None = None) -> str | None:
    """Why ONNX Runtime's GroupQueryAttention (RoPE inside) would refuse these shapes, or None."""
    if head_dim % ROTARY_HEAD_DIM_MULTIPLE:
        return f"GroupQueryAttention needs head_dim % {ROTARY_HEAD_DIM_MULTIPLE} == 0; this model has {head_dim}"
    if heads and kv_heads and heads % kv_heads:
        return (
            f"GroupQueryAttention needs num_heads % kv_heads == 0; this model has {heads} query heads, "
            f"{kv_heads} KV heads"
        )
    return None


def rewrite_attention(model, base_dir: Path, windows: list[int | None] | None = None) -> GqaResult:
    """Rewrite `model` (an onnx ModelProto of a prefix-cache target, external data not loaded) in place;
    `windows`: each layer's sliding window (None: full attention), as export.json records it (gpt-oss)."""
    from dflash_cli.ortcompile.row_pads import merge_row_pads

    graph = model.graph
    result = GqaResult()
    index = GraphIndex.of(graph)
    try:  # every check comes before the first change: a graph skipped is left exactly as it was
        found = find_projections(graph, index)
        attn = _attention_of(graph, index, found, windows, base_dir)
        layers = _layer_plans(attn, found, index)
    except _Skip as skip:
        result.skipped.append(str(skip))
        return result

    new_nodes, new_inits = _call_nodes(attn)
    inserted_before: dict[int, list] = {}  # id(o_proj node) -> nodes to place right before it
    for layer in layers:
        nodes = _attention_nodes(layer, attn, windows)
        layer.o_proj.input[0] = nodes[-1].output[0]  # the attention's output, cut back to the call's rows
        inserted_before[id(layer.o_proj)] = nodes
        _cache_in_place(layer.index, attn, index)
        result.layers += 1
    _reorder_nodes(graph, new_nodes, inserted_before)
    result.merged_pads = merge_row_pads(graph)
    _install(model, new_inits)
    return result


class _Skip(Exception):
    """Why the graph is left as it was (GqaResult.skipped)."""


@dataclass(frozen=True)
class _Attention:
    """What the rewrite shares across layers: the cache layout, the RoPE tables, the sinks."""

    layers: list[int]
    kv_heads: int
    head_dim: int
    elem: int  # the cache's ONNX element type
    batch: int | str  # the cache's rows: one per sequence
    halves: dict[str, np.ndarray]  # "cos" / "sin" -> the first half of each rotate-half table row
    sinks: dict[int, str]  # layer -> its attention sinks initializer (gpt-oss)


@dataclass(frozen=True)
class _Layer:
    """One layer's rewrite: what GroupQueryAttention reads and the o_proj that reads its output."""

    index: int
    q: tuple[str, bool]  # (tensor, whether it is [b, s, heads, d] and needs flattening): normed_heads
    k: tuple[str, bool]
    v: str
    o_proj: Any
    heads: int


def _attention_of(graph, index: GraphIndex, found: Projections, windows, base_dir: Path) -> _Attention:
    """The shared facts of a prefix-cache target this rewrite handles; raises _Skip for any other graph."""

    inputs, outputs = index.inputs, index.outputs
    layers = sorted(i for i in found.outputs if f"present_key.{i}" in outputs and f"present_value.{i}" in outputs)
    plain_inputs = {n for n in inputs if not n.startswith(("past_key.", "past_value."))}
    if any(n.startswith("past_delta") for n in plain_inputs):
        # Its gated, partially rotated attention is not the pattern matched here; its exported form is kept.
        raise _Skip("a hybrid linear-attention target (gated attention with partial RoPE)")
    # gpt-oss: each layer's attention sinks (the kernel's head_sink) and window (its local_window_size)
    sinks = {int(m.group(1)): t.name for t in graph.initializer if (m := _SINKS.search(t.name))}
    if sinks and windows is None:
        raise _Skip("attention sinks without the export's attention_windows (export.json)")
    if not layers or plain_inputs != {"input_ids", "position_ids"}:  # a draft (bidirectional block) is left alone
        found_io = f"inputs {sorted(plain_inputs)}, {len(layers)} present_key.N"
        raise _Skip(f"not a prefix-cache target graph ({found_io})")
    tables = _rope_tables(graph)
    shape = [d.dim_value for d in inputs[f"past_key.{layers[0]}"].type.tensor_type.shape.dim]
    if len(shape) != 4 or not shape[2] or not shape[3]:
        raise _Skip(f"past_key.{layers[0]} is not [1, past, kv_heads, head_dim]")
    kv_heads, head_dim = shape[2], shape[3]
    refusal = kernel_refusal(head_dim)
    if refusal:
        raise _Skip(refusal)
    halves = _rotate_half_halves(tables, head_dim, base_dir)
    elem = inputs[f"past_key.{layers[0]}"].type.tensor_type.elem_type
    batch = inputs["input_ids"].type.tensor_type.shape.dim[0].dim_param or 1  # a cache row per sequence
    return _Attention(layers, kv_heads, head_dim, elem, batch, halves, sinks)


def _rope_tables(graph) -> dict:
    """The one pair of RoPE tables, "cos" / "sin" -> initializer [ctx_len, head_dim]."""
    tables = {}
    for t in graph.initializer:
        for kind in ("cos", "sin"):
            if t.name.endswith(f"rotary.{kind}_table") and len(t.dims) == 2:
                tables[kind] = t
    if any(re.search(r"rotary_\w+\.cos_table$", t.name) for t in graph.initializer):  # Gemma 4 (docstring)
        raise _Skip("RoPE tables of several layer kinds (rotary_*.cos_table)")
    if set(tables) != {"cos", "sin"}:
        raise _Skip("no RoPE tables (rotary.cos_table / sin_table) in the graph")
    return tables


def _rotate_half_halves(tables: dict, head_dim: int, base_dir: Path) -> dict[str, np.ndarray]:
    """Each table's first half: GroupQueryAttention's cos/sin caches (the tables repeat their halves)."""
    from dflash_cli.exporting.onnx_data import read_initializer

    halves = {}
    for kind, t in tables.items():
        full = np.asarray(read_initializer(t, base_dir), dtype=np.float32)
        if full.shape[1] != head_dim or not np.array_equal(full[:, : head_dim // 2], full[:, head_dim // 2 :]):
            raise _Skip(f"{t.name} is not a rotate-half table of width {head_dim}")
        halves[kind] = full[:, : head_dim // 2]
    return halves


def _layer_plans(attn: _Attention, found: Projections, index: GraphIndex) -> list[_Layer]:
    """Each layer's q/k/v as GroupQueryAttention reads them; raises _Skip where a layer does not match."""
    plans = []
    for i in attn.layers:
        p = found.outputs[i]
        if set(p) != {"q", "k", "v", "o"} or i not in found.o_proj:
            raise _Skip(f"layer {i}: projections {sorted(p)}")
        q = normed_heads(with_bias(p["q"], index.single, index.inits), index.single)
        k = normed_heads(with_bias(p["k"], index.single, index.inits), index.single)
        if q is None or k is None:
            raise _Skip(f"layer {i}: q/k do not go through one fused norm or none")
        v = with_bias(p["v"], index.single, index.inits)
        width = found.q_width.get(i)
        heads = width // attn.head_dim if width and width % attn.head_dim == 0 else None
        if heads is None:
            raise _Skip(f"layer {i}: cannot tell the number of query heads")
        refusal = kernel_refusal(attn.head_dim, heads, attn.kv_heads)
        if refusal:
            raise _Skip(refusal)
        plans.append(_Layer(i, q, k, v, found.o_proj[i], heads))
    return plans


_ROPE_CACHES = {"cos": "gqa.cos_cache", "sin": "gqa.sin_cache"}


def _call_nodes(attn: _Attention) -> tuple[list, list]:
    """(nodes, initializers) every layer shares: the RoPE caches, the rows attended, the cache lengths."""
    from onnx import TensorProto, helper, numpy_helper

    np_dtype = helper.tensor_dtype_to_np_dtype(attn.elem)
    new_inits = []
    for kind, arr in attn.halves.items():
        # One row more than the cache has slots: a one-token call at the last slot attends as two rows,
        # and its padding row sits in the spare slot past ctx_len (SPARE_SLOTS; never read, so its angle
        # does not matter).
        arr = np.concatenate([arr, arr[-1:]])
        new_inits.append(numpy_helper.from_array(np.ascontiguousarray(arr.astype(np_dtype)), _ROPE_CACHES[kind]))
    new_inits += [
        numpy_helper.from_array(np.array([0], np.int64), "gqa.zero"),
        numpy_helper.from_array(np.array([1], np.int64), "gqa.one"),
        numpy_helper.from_array(np.array([2], np.int64), "gqa.two"),
        numpy_helper.from_array(np.array([0, 0, -1], np.int64), "gqa.flat_heads"),
    ]
    # Cache length after the call = start + rows attended (padding rows too: their K/V land past the real
    # ones, overwritten before anyone reads them); the kernel's total is the longest sequence's.
    # A one-token call attends as two rows (the token repeated at the next slot): the kernel's one-row
    # path rounds differently from a block's, and plain decoding must see a verify block's numbers
    # (backends/single_row.py). Only q/k/v are padded, so the projections keep their one-row cost.
    new_nodes = [
        helper.make_node("Gather", ["position_ids", "gqa.zero"], ["gqa.start2d"], axis=1),
        helper.make_node("Squeeze", ["gqa.start2d", "gqa.one"], ["gqa.start"]),  # [b]
        helper.make_node("Shape", ["input_ids"], ["gqa.seq_len"], start=1, end=2),
        helper.make_node("Max", ["gqa.seq_len", "gqa.two"], ["gqa.rows"]),
        helper.make_node("Sub", ["gqa.rows", "gqa.seq_len"], ["gqa.pad_rows"]),
        helper.make_node("Concat", ["gqa.zero"] * 4 + ["gqa.pad_rows", "gqa.zero"], ["gqa.pads"], axis=0),
        helper.make_node("Add", ["gqa.start", "gqa.rows"], ["gqa.total64"]),
        helper.make_node("Sub", ["gqa.total64", "gqa.one"], ["gqa.seqlens64"]),
        helper.make_node("Cast", ["gqa.seqlens64"], ["gqa.seqlens_k"], to=TensorProto.INT32),
        helper.make_node("ReduceMax", ["gqa.total64"], ["gqa.total_scalar64"], keepdims=0),  # the longest
        helper.make_node("Cast", ["gqa.total_scalar64"], ["gqa.total_len"], to=TensorProto.INT32),
    ]
    return new_nodes, new_inits


def _attention_nodes(layer: _Layer, attn: _Attention, windows) -> list:
    """Layer `layer`'s GroupQueryAttention and the reshapes and pads around it, to place before its o_proj;
    the last one's output is the attention's output for the call's rows."""
    from onnx import helper

    i = layer.index
    nodes = []
    flat = []
    for tag, (tensor, normed) in (("q", layer.q), ("k", layer.k)):
        if normed:  # [b, s, heads, d] after the per-head norm -> [b, s, heads * d]
            name = f"gqa.{i}.{tag}"
            nodes.append(helper.make_node("Reshape", [tensor, "gqa.flat_heads"], [name]))
            flat.append(name)
        else:
            flat.append(tensor)
    padded = []
    for tag, tensor in zip("qkv", (flat[0], flat[1], layer.v)):
        padded.append(f"gqa.{i}.{tag}_rows")
        nodes.append(helper.make_node("Pad", [tensor, "gqa.pads"], [padded[-1]], mode="edge"))
    out = f"gqa.{i}.attention"
    nodes.append(
        helper.make_node(
            "GroupQueryAttention",
            [*padded, f"past_key.{i}", f"past_value.{i}", "gqa.seqlens_k", "gqa.total_len"]
            + [_ROPE_CACHES["cos"], _ROPE_CACHES["sin"]]
            + (["", "", attn.sinks[i]] if i in attn.sinks else []),
            [out + "_rows", f"present_key.{i}", f"present_value.{i}"],
            name=f"layers.{i}.GroupQueryAttention",
            domain="com.microsoft",
            num_heads=layer.heads,
            kv_num_heads=attn.kv_heads,
            do_rotary=1,
            scale=float(attn.head_dim**-0.5),
            **({"local_window_size": windows[i]} if windows and windows[i] else {}),
        )
    )
    nodes.append(helper.make_node("Slice", [out + "_rows", "gqa.zero", "gqa.seq_len", "gqa.one"], [out]))
    return nodes


def _cache_in_place(i: int, attn: _Attention, index: GraphIndex) -> None:
    """Layer i's past_* and present_* as the one buffer they now share, [b, kv_heads, cache_len, head_dim]."""
    from onnx import helper

    for kv in ("key", "value"):
        cache_dims = [attn.batch, attn.kv_heads, "cache_len", attn.head_dim]
        index.inputs[f"past_{kv}.{i}"].CopyFrom(helper.make_tensor_value_info(f"past_{kv}.{i}", attn.elem, cache_dims))
        if f"present_{kv}.{i}" in index.outputs:
            index.outputs[f"present_{kv}.{i}"].CopyFrom(
                helper.make_tensor_value_info(f"present_{kv}.{i}", attn.elem, cache_dims)
            )


def _reorder_nodes(graph, new_nodes: list, inserted_before: dict[int, list]) -> None:
    """The shared nodes first, each layer's before its o_proj; the old present_* producers are now dead, so
    every node nothing live reads is dropped."""
    ordered = list(new_nodes)
    for node in graph.node:
        if node.output and any(o.startswith("present_") for o in node.output):
            continue  # superseded by the GroupQueryAttention outputs of the same names
        ordered += inserted_before.get(id(node), [])
        ordered.append(node)
    del graph.node[:]
    graph.node.extend(_live(ordered, {o.name for o in graph.output}))


def _install(model, new_inits: list) -> None:
    """The new initializers in, those no node reads any more out; the model marked as in-place-cache."""
    from onnx import helper

    graph = model.graph
    graph.initializer.extend(new_inits)
    used = {name for n in graph.node for name in n.input}
    keep = [t for t in graph.initializer if t.name in used]
    del graph.initializer[:]
    graph.initializer.extend(keep)
    del graph.value_info[:]  # shapes recorded for the old layout would contradict the new one
    if not any(o.domain == "com.microsoft" for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    entry = model.metadata_props.add()
    entry.key, entry.value = KV_LAYOUT_KEY, KV_IN_PLACE


def _live(nodes: list, wanted: set[str]) -> list:
    """`nodes` (in order) minus those whose outputs nothing live reads."""
    needed = set(wanted)
    keep = []
    for node in reversed(nodes):
        if any(o in needed for o in node.output):
            keep.append(node)
            needed.update(i for i in node.input if i)
    return keep[::-1]
