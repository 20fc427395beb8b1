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

What it relies on, all checked or anchored by name rather than by op patterns:
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

import numpy as np

KV_LAYOUT_KEY = "dflash.kv_cache"
KV_IN_PLACE = "in_place_bnsh"  # past_* / present_* share [b, kv_heads, ctx_len + SPARE_SLOTS, head_dim] buffers
SPARE_SLOTS = 1  # for the padding row of a one-token call at the last slot (one-token calls attend as two rows)
_PROJ = re.compile(r"layers\.(\d+)\.self_attn\.([qkvo])_proj\.weight(\.w\d+)?$")
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
    from onnx import TensorProto, helper, numpy_helper

    from dflash_cli.exporting.onnx_data import read_initializer

    graph = model.graph
    result = GqaResult()
    inputs = {i.name: i for i in graph.input}
    outputs = {o.name: o for o in graph.output}
    inits = {t.name: t for t in graph.initializer}
    producers = {o: n for n in graph.node for o in n.output}
    consumers: dict[str, list] = {}
    for n in graph.node:
        for name in n.input:
            consumers.setdefault(name, []).append(n)

    def weight_of(node) -> str | None:
        if node.op_type not in ("MatMul", "MatMulNBits") or len(node.input) < 2:
            return None
        b = node.input[1]
        if b not in inits and b in producers and producers[b].op_type == "Transpose":
            b = producers[b].input[0]
        return b if b in inits else None

    def single(name: str, op: str):
        users = consumers.get(name, [])
        return users[0] if len(users) == 1 and users[0].op_type == op and name not in outputs else None

    projections: dict[int, dict[str, str]] = {}  # layer -> q/k/v/o -> the projection's output tensor
    o_proj: dict[int, object] = {}  # layer -> the o_proj node (its input becomes the attention's output)
    q_width: dict[int, int | None] = {}
    for node in graph.node:
        for w, out, width in _projections(node, weight_of, consumers, inits):
            m = _PROJ.search(w)
            if m:
                layer, kind = int(m.group(1)), m.group(2)
                projections.setdefault(layer, {})[kind] = out
                if kind == "o":
                    o_proj[layer] = node
                if kind == "q":
                    q_width[layer] = width
    layers = sorted(i for i in projections if f"present_key.{i}" in outputs and f"present_value.{i}" in outputs)
    plain_inputs = {n for n in inputs if not n.startswith(("past_key.", "past_value."))}
    if any(n.startswith("past_delta") for n in plain_inputs):
        # Its gated, partially rotated attention is not the pattern matched here; its exported form is kept.
        result.skipped.append("a hybrid linear-attention target (gated attention with partial RoPE)")
        return result
    # gpt-oss: each layer's attention sinks (the kernel's head_sink) and window (its local_window_size)
    sinks = {int(m.group(1)): t.name for t in graph.initializer if (m := _SINKS.search(t.name))}
    if sinks and windows is None:
        result.skipped.append("attention sinks without the export's attention_windows (export.json)")
        return result
    if not layers or plain_inputs != {"input_ids", "position_ids"}:  # a draft (bidirectional block) is left alone
        found = f"inputs {sorted(plain_inputs)}, {len(layers)} present_key.N"
        result.skipped.append(f"not a prefix-cache target graph ({found})")
        return result
    tables = {}
    for t in graph.initializer:
        for kind in ("cos", "sin"):
            if t.name.endswith(f"rotary.{kind}_table") and len(t.dims) == 2:
                tables[kind] = t
    if any(re.search(r"rotary_\w+\.cos_table$", t.name) for t in graph.initializer):  # Gemma 4 (docstring)
        result.skipped.append("RoPE tables of several layer kinds (rotary_*.cos_table)")
        return result
    if set(tables) != {"cos", "sin"}:
        result.skipped.append("no RoPE tables (rotary.cos_table / sin_table) in the graph")
        return result
    shape = [d.dim_value for d in inputs[f"past_key.{layers[0]}"].type.tensor_type.shape.dim]
    if len(shape) != 4 or not shape[2] or not shape[3]:
        result.skipped.append(f"past_key.{layers[0]} is not [1, past, kv_heads, head_dim]")
        return result
    kv_heads, head_dim = shape[2], shape[3]
    refusal = kernel_refusal(head_dim)
    if refusal:
        result.skipped.append(refusal)
        return result
    halves = {}
    for kind, t in tables.items():
        full = np.asarray(read_initializer(t, base_dir), dtype=np.float32)
        if full.shape[1] != head_dim or not np.array_equal(full[:, : head_dim // 2], full[:, head_dim // 2 :]):
            result.skipped.append(f"{t.name} is not a rotate-half table of width {head_dim}")
            return result
        halves[kind] = full[:, : head_dim // 2]
    elem = inputs[f"past_key.{layers[0]}"].type.tensor_type.elem_type
    batch = inputs["input_ids"].type.tensor_type.shape.dim[0].dim_param or 1  # a cache row per sequence
    np_dtype = helper.tensor_dtype_to_np_dtype(elem)

    plans = []
    for i in layers:
        p = projections[i]
        if set(p) != {"q", "k", "v", "o"} or i not in o_proj:
            result.skipped.append(f"layer {i}: projections {sorted(p)}")
            return result
        q = _normed_heads(_with_bias(p["q"], single, inits), single)
        k = _normed_heads(_with_bias(p["k"], single, inits), single)
        if q is None or k is None:
            result.skipped.append(f"layer {i}: q/k do not go through one fused norm or none")
            return result
        v = _with_bias(p["v"], single, inits)
        width = q_width.get(i)
        heads = width // head_dim if width and width % head_dim == 0 else None
        if heads is None:
            result.skipped.append(f"layer {i}: cannot tell the number of query heads")
            return result
        refusal = kernel_refusal(head_dim, heads, kv_heads)
        if refusal:
            result.skipped.append(refusal)
            return result
        plans.append((i, q, k, v, o_proj[i], heads))

    new_nodes, new_inits = [], []
    names = {"cos": "gqa.cos_cache", "sin": "gqa.sin_cache"}
    for kind, arr in halves.items():
        # One row more than the cache has slots: a one-token call at the last slot attends as two rows,
        # and its padding row sits in the spare slot past ctx_len (SPARE_SLOTS; never read, so its angle
        # does not matter).
        arr = np.concatenate([arr, arr[-1:]])
        new_inits.append(numpy_helper.from_array(np.ascontiguousarray(arr.astype(np_dtype)), names[kind]))
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
    new_nodes += [
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
    inserted_before: dict[int, list] = {}  # id(o_proj node) -> nodes to place right before it
    for i, q, k, v, o_proj, heads in plans:
        nodes = []
        flat = []
        for tag, (tensor, normed) in (("q", q), ("k", k)):
            if normed:  # [b, s, heads, d] after the per-head norm -> [b, s, heads * d]
                name = f"gqa.{i}.{tag}"
                nodes.append(helper.make_node("Reshape", [tensor, "gqa.flat_heads"], [name]))
                flat.append(name)
            else:
                flat.append(tensor)
        padded = []
        for tag, tensor in zip("qkv", (flat[0], flat[1], v)):
            padded.append(f"gqa.{i}.{tag}_rows")
            nodes.append(helper.make_node("Pad", [tensor, "gqa.pads"], [padded[-1]], mode="edge"))
        out = f"gqa.{i}.attention"
        nodes.append(
            helper.make_node(
                "GroupQueryAttention",
                [*padded, f"past_key.{i}", f"past_value.{i}", "gqa.seqlens_k", "gqa.total_len"]
                + [names["cos"], names["sin"]]
                + (["", "", sinks[i]] if i in sinks else []),
                [out + "_rows", f"present_key.{i}", f"present_value.{i}"],
                name=f"layers.{i}.GroupQueryAttention",
                domain="com.microsoft",
                num_heads=heads,
                kv_num_heads=kv_heads,
                do_rotary=1,
                scale=float(head_dim**-0.5),
                **({"local_window_size": windows[i]} if windows and windows[i] else {}),
            )
        )
        nodes.append(helper.make_node("Slice", [out + "_rows", "gqa.zero", "gqa.seq_len", "gqa.one"], [out]))
        o_proj.input[0] = out
        inserted_before[id(o_proj)] = nodes
        for kv in ("key", "value"):
            cache_dims = [batch, kv_heads, "cache_len", head_dim]
            inputs[f"past_{kv}.{i}"].CopyFrom(helper.make_tensor_value_info(f"past_{kv}.{i}", elem, cache_dims))
            if f"present_{kv}.{i}" in outputs:
                outputs[f"present_{kv}.{i}"].CopyFrom(
                    helper.make_tensor_value_info(f"present_{kv}.{i}", elem, cache_dims)
                )
        result.layers += 1

    # The old present_* producers are now dead; drop every node nothing live reads.
    ordered = list(new_nodes)
    for node in graph.node:
        if node.output and any(o.startswith("present_") for o in node.output):
            continue  # superseded by the GroupQueryAttention outputs of the same names
        ordered += inserted_before.get(id(node), [])
        ordered.append(node)
    del graph.node[:]
    graph.node.extend(_live(ordered, {o.name for o in graph.output}))
    from dflash_cli.ortcompile.row_pads import merge_row_pads

    result.merged_pads = merge_row_pads(graph)
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
    return result


def _with_bias(name: str, single, inits) -> str:
    add = single(name, "Add")
    if add is not None and any(i in inits for i in add.input):
        return add.output[0]
    return name


def _normed_heads(proj_out: str, single) -> tuple[str, bool] | None:
    """(tensor to feed GroupQueryAttention, whether it is [b, s, heads, d] and needs flattening)."""
    reshape = single(proj_out, "Reshape")
    if reshape is None:
        return None
    norm = single(reshape.output[0], "SimplifiedLayerNormalization")
    if norm is not None:
        return norm.output[0], True
    # No per-head norm (Llama): the projection's output is already [b, s, heads * d].
    return proj_out, False


def _projections(node, weight_of, consumers, inits):
    """(weight name, output tensor, output width) of each projection `node` computes: one for a MatMul,
    one per part for a stacked MatMulNBits (ortcompile/quantize.py: q/k/v in one node, then a Split)."""
    from onnx import numpy_helper

    from dflash_cli.ortcompile.quantize import STACKED_WEIGHTS_KEY

    parts = next((p.value.split(",") for p in node.metadata_props if p.key == STACKED_WEIGHTS_KEY), None)
    if parts is None:
        w = weight_of(node)
        return [(w, node.output[0], _out_features(node, inits[w]))] if w else []
    users = consumers.get(node.output[0], [])
    if len(users) != 1 or users[0].op_type != "Split" or len(users[0].output) != len(parts):
        return []
    split = users[0]
    sizes = inits.get(split.input[1]) if len(split.input) > 1 else None
    widths = [int(x) for x in numpy_helper.to_array(sizes)] if sizes is not None else [None] * len(parts)
    return list(zip(parts, split.output, widths))


def _out_features(node, weight) -> int | None:
    """A projection's output width: MatMulNBits says N; a MatMul reads W [in, out] or Transpose(W [out, in])."""
    if node.op_type == "MatMulNBits":
        return next((a.i for a in node.attribute if a.name == "N"), None)
    if len(weight.dims) != 2:
        return None
    return weight.dims[1] if node.input[1] == weight.name else weight.dims[0]


def _live(nodes: list, wanted: set[str]) -> list:
    """`nodes` (in order) minus those whose outputs nothing live reads."""
    needed = set(wanted)
    keep = []
    for node in reversed(nodes):
        if any(o in needed for o in node.output):
            keep.append(node)
            needed.update(i for i in node.input if i)
    return keep[::-1]
