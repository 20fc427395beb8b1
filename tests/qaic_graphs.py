"""Tiny ONNX graphs with the export contract's IO (names, dtypes, one symbolic `seq_len`).

Test helper for the QAIC backend and the readiness checks: small random weights, but the real
input/output names and shapes, KV scattered into `past_*` at the positions (-1 -> spare slot
ctx_len - 1), attention masked by position, ArgMax tokens. Not a model of anything.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from dflash_cli.modeling.layers import MASKED_SCORE

OPSET = 17
SEQ = "seq_len"


@dataclass(frozen=True)
class TinyDims:
    vocab: int = 32
    hidden: int = 8
    kv_heads: int = 2
    head_dim: int = 4
    ctx_len: int = 16
    block_size: int = 4
    prefill_seq_len: int = 8
    target_layers: int = 2
    draft_layers: int = 1


class _Builder:
    """Collects nodes and initializers; names are unique per builder."""

    def __init__(self, seed: int) -> None:
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []
        self.rng = np.random.default_rng(seed)
        self.n = 0

    def name(self, hint: str) -> str:
        self.n += 1
        return f"{hint}_{self.n}"

    def const(self, value: np.ndarray, hint: str = "c") -> str:
        name = self.name(hint)
        self.inits.append(numpy_helper.from_array(np.asarray(value), name))
        return name

    def weight(self, *shape: int, hint: str = "w") -> str:
        return self.const((self.rng.standard_normal(shape) / np.sqrt(shape[0])).astype(np.float32), hint)

    def op(self, op_type: str, inputs: list[str], out: str | None = None, **attrs: object) -> str:
        out = out or self.name(op_type.lower())
        self.nodes.append(helper.make_node(op_type, inputs, [out], name=self.name(op_type), **attrs))
        return out


def _kv_value_infos(layers: int, d: TinyDims) -> tuple[list, list]:
    shape = [1, d.kv_heads, d.ctx_len, d.head_dim]
    ins, outs = [], []
    for i in range(layers):
        for kind in ("key", "value"):
            ins.append(helper.make_tensor_value_info(f"past_{kind}.{i}", TensorProto.FLOAT, shape))
            outs.append(helper.make_tensor_value_info(f"past_{kind}.{i}_RetainedState", TensorProto.FLOAT, shape))
    return ins, outs


def _heads(b: _Builder, x: str, w: str, d: TinyDims) -> str:
    """[1, S, H] @ w -> [1, K, S, D]."""
    y = b.op("MatMul", [x, w])
    y = b.op("Reshape", [y, b.const(np.array([1, -1, d.kv_heads, d.head_dim], np.int64))])
    return b.op("Transpose", [y], perm=[0, 2, 1, 3])


def _scatter_index(b: _Builder, positions: str, like: str, d: TinyDims) -> str:
    """Positions [1, S] -> ScatterElements indices [1, K, S, D]; -1 goes to the spare slot."""
    neg = b.op("Less", [positions, b.const(np.array(0, np.int64))])
    fixed = b.op("Where", [neg, b.const(np.array(d.ctx_len - 1, np.int64)), positions])
    idx = b.op("Unsqueeze", [fixed, b.const(np.array([1, 3], np.int64))])
    return b.op("Expand", [idx, b.op("Shape", [like])])


def build_target(
    d: TinyDims = TinyDims(),
    *,
    seed: int = 0,
    batch_symbol: str | None = None,
    extra_op: str | None = None,
    logits: bool = True,
    mask_value: float = MASKED_SCORE,
) -> onnx.ModelProto:
    """target.onnx: tokens (+ logits), context_features, retained KV for `target_layers` layers.

    batch_symbol: make the batch dim symbolic too (readiness must then report it).
    extra_op: "NonZero" adds a NonZero node feeding an extra output (op + dynamic shape).
    """
    b = _Builder(seed)
    embed = b.weight(d.vocab, d.hidden, hint="embed")
    x = b.op("Gather", [embed, "input_ids"])
    slots = b.op(
        "Range",
        [b.const(np.array(0, np.int64)), b.const(np.array(d.ctx_len, np.int64)), b.const(np.array(1, np.int64))],
    )
    slots4 = b.op("Unsqueeze", [slots, b.const(np.array([0, 1, 2], np.int64))])
    pos4 = b.op("Unsqueeze", ["position_ids", b.const(np.array([1, 3], np.int64))])
    future = b.op("Greater", [slots4, pos4])  # [1, 1, S, C]: slots after the query position
    neg_big = b.const(np.array(mask_value, np.float32), "neg_min")  # as the real export: finite in fp16
    scale = b.const(np.array(1.0 / np.sqrt(d.head_dim), np.float32), "scale")
    idx = None
    for i in range(d.target_layers):
        q = _heads(b, x, b.weight(d.hidden, d.kv_heads * d.head_dim), d)
        k = _heads(b, x, b.weight(d.hidden, d.kv_heads * d.head_dim), d)
        v = _heads(b, x, b.weight(d.hidden, d.kv_heads * d.head_dim), d)
        idx = idx or _scatter_index(b, "position_ids", k, d)
        kc = b.op("ScatterElements", [f"past_key.{i}", idx, k], f"past_key.{i}_RetainedState", axis=2)
        vc = b.op("ScatterElements", [f"past_value.{i}", idx, v], f"past_value.{i}_RetainedState", axis=2)
        scores = b.op("Mul", [b.op("MatMul", [q, b.op("Transpose", [kc], perm=[0, 1, 3, 2])]), scale])
        probs = b.op("Softmax", [b.op("Where", [future, neg_big, scores])], axis=-1)
        attn = b.op("Transpose", [b.op("MatMul", [probs, vc])], perm=[0, 2, 1, 3])
        attn = b.op("Reshape", [attn, b.const(np.array([1, -1, d.kv_heads * d.head_dim], np.int64))])
        x = b.op("Add", [x, b.op("MatMul", [attn, b.weight(d.kv_heads * d.head_dim, d.hidden)])])
    feats = b.op("Mul", [x, b.weight(d.hidden, hint="norm")], "context_features")
    logit_name = "logits" if logits else None
    lg = b.op("MatMul", [feats, b.weight(d.hidden, d.vocab, hint="lm_head")], logit_name)
    b.op("ArgMax", [lg], "tokens", axis=2, keepdims=0)

    batch = batch_symbol or 1
    inputs = [
        helper.make_tensor_value_info("input_ids", TensorProto.INT64, [batch, SEQ]),
        helper.make_tensor_value_info("position_ids", TensorProto.INT64, [batch, SEQ]),
    ]
    outputs = [helper.make_tensor_value_info("tokens", TensorProto.INT64, [batch, SEQ])]
    if logits:
        outputs.append(helper.make_tensor_value_info("logits", TensorProto.FLOAT, [batch, SEQ, d.vocab]))
    outputs.append(helper.make_tensor_value_info("context_features", TensorProto.FLOAT, [batch, SEQ, d.hidden]))
    kv_in, kv_out = _kv_value_infos(d.target_layers, d)
    if extra_op == "NonZero":
        b.op("NonZero", ["input_ids"], "nonzero_ids")
        outputs.append(helper.make_tensor_value_info("nonzero_ids", TensorProto.INT64, [2, "nnz"]))
    graph = helper.make_graph(b.nodes, "tiny_target", inputs + kv_in, outputs + kv_out, b.inits)
    return _model(graph)


def build_draft(d: TinyDims = TinyDims(), *, seed: int = 1) -> onnx.ModelProto:
    """draft.onnx: block of B tokens attends to the context cache (before the block) + itself."""
    b = _Builder(seed)
    embed = b.weight(d.vocab, d.hidden, hint="embed")
    x = b.op("Gather", [embed, "input_ids"])  # [1, B, H]
    slots = b.op(
        "Range",
        [b.const(np.array(0, np.int64)), b.const(np.array(d.ctx_len, np.int64)), b.const(np.array(1, np.int64))],
    )
    slots4 = b.op("Unsqueeze", [slots, b.const(np.array([0, 1, 2], np.int64))])
    start = b.op(
        "Slice",
        [
            "position_ids",
            b.const(np.array([0], np.int64)),
            b.const(np.array([1], np.int64)),
            b.const(np.array([1], np.int64)),
        ],
    )  # [1, 1]: the block's first position
    start4 = b.op("Unsqueeze", [start, b.const(np.array([1, 3], np.int64))])
    # Context strictly before the block is visible: slot > start - 1 is masked.
    hidden_slots = b.op("Greater", [slots4, b.op("Sub", [start4, b.const(np.array(1, np.int64))])])
    neg_big = b.const(np.array(MASKED_SCORE, np.float32), "neg_min")  # as the real export: finite in fp16
    scale = b.const(np.array(1.0 / np.sqrt(d.head_dim), np.float32), "scale")
    idx = None
    for i in range(d.draft_layers):
        wk = b.weight(d.hidden, d.kv_heads * d.head_dim)
        wv = b.weight(d.hidden, d.kv_heads * d.head_dim)
        k_ctx, v_ctx = _heads(b, "context_features", wk, d), _heads(b, "context_features", wv, d)
        idx = idx or _scatter_index(b, "context_position_ids", k_ctx, d)
        kc = b.op("ScatterElements", [f"past_key.{i}", idx, k_ctx], f"past_key.{i}_RetainedState", axis=2)
        vc = b.op("ScatterElements", [f"past_value.{i}", idx, v_ctx], f"past_value.{i}_RetainedState", axis=2)
        q = _heads(b, x, b.weight(d.hidden, d.kv_heads * d.head_dim), d)
        k_blk, v_blk = _heads(b, x, wk, d), _heads(b, x, wv, d)
        s_ctx = b.op("Mul", [b.op("MatMul", [q, b.op("Transpose", [kc], perm=[0, 1, 3, 2])]), scale])
        s_ctx = b.op("Where", [hidden_slots, neg_big, s_ctx])
        s_blk = b.op("Mul", [b.op("MatMul", [q, b.op("Transpose", [k_blk], perm=[0, 1, 3, 2])]), scale])
        probs = b.op("Softmax", [b.op("Concat", [s_ctx, s_blk], axis=-1)], axis=-1)
        attn = b.op("MatMul", [probs, b.op("Concat", [vc, v_blk], axis=2)])
        attn = b.op("Transpose", [attn], perm=[0, 2, 1, 3])
        attn = b.op("Reshape", [attn, b.const(np.array([1, -1, d.kv_heads * d.head_dim], np.int64))])
        x = b.op("Add", [x, b.op("MatMul", [attn, b.weight(d.kv_heads * d.head_dim, d.hidden)])])
    lg = b.op("MatMul", [x, b.weight(d.hidden, d.vocab, hint="lm_head")])
    lg = b.op(
        "Slice",
        [
            lg,
            b.const(np.array([1], np.int64)),
            b.const(np.array([d.block_size], np.int64)),
            b.const(np.array([1], np.int64)),
        ],
        "draft_logits",
    )
    b.op("ArgMax", [lg], "draft_tokens", axis=2, keepdims=0)

    bs = d.block_size
    inputs = [
        helper.make_tensor_value_info("input_ids", TensorProto.INT64, [1, bs]),
        helper.make_tensor_value_info("position_ids", TensorProto.INT64, [1, bs]),
        helper.make_tensor_value_info("context_features", TensorProto.FLOAT, [1, SEQ, d.hidden]),
        helper.make_tensor_value_info("context_position_ids", TensorProto.INT64, [1, SEQ]),
    ]
    outputs = [
        helper.make_tensor_value_info("draft_tokens", TensorProto.INT64, [1, bs - 1]),
        helper.make_tensor_value_info("draft_logits", TensorProto.FLOAT, [1, bs - 1, d.vocab]),
    ]
    kv_in, kv_out = _kv_value_infos(d.draft_layers, d)
    graph = helper.make_graph(b.nodes, "tiny_draft", inputs + kv_in, outputs + kv_out, b.inits)
    return _model(graph)


def _model(graph: onnx.GraphProto) -> onnx.ModelProto:
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)], producer_name="dflash-tests")
    model.ir_version = 8  # what onnxruntime of any recent version loads
    onnx.checker.check_model(model)
    return model


def with_local_function(model: onnx.ModelProto) -> onnx.ModelProto:
    """Copy of `model` whose `tokens` ArgMax runs inside a local function (for -sub-functions)."""
    model = onnx.ModelProto.FromString(model.SerializeToString())
    node = next(n for n in model.graph.node if n.output[0] == "tokens")
    body = helper.make_node("ArgMax", ["x"], ["y"], axis=2, keepdims=0)
    fn = helper.make_function("dflash.test", "TokenArgMax", ["x"], ["y"], [body], [helper.make_opsetid("", OPSET)])
    call = helper.make_node("TokenArgMax", list(node.input), ["tokens"], domain="dflash.test", name="call_argmax")
    model.graph.node.remove(node)
    model.graph.node.append(call)
    model.functions.append(fn)
    model.opset_import.append(helper.make_opsetid("dflash.test", 1))
    return model


def write_export_dir(
    dest: Path,
    d: TinyDims = TinyDims(),
    *,
    external_data: bool = False,
    target: onnx.ModelProto | None = None,
) -> Path:
    """An export artifact: target.onnx, draft.onnx and export.json, as the export stage writes them."""
    dest.mkdir(parents=True, exist_ok=True)
    models = {"target": target or build_target(d), "draft": build_draft(d)}
    graphs = {}
    for name, model in models.items():
        path = dest / f"{name}.onnx"
        if external_data:
            onnx.save_model(
                model,
                str(path),
                save_as_external_data=True,
                all_tensors_to_one_file=True,
                location=f"{name}.onnx.data",
                size_threshold=0,
            )
        else:
            onnx.save_model(model, str(path))
        layers = d.target_layers if name == "target" else d.draft_layers
        seq_lens = {"prefill": d.prefill_seq_len, "verify" if name == "target" else "decode": d.block_size}
        graphs[name] = {
            "onnx": path.name,
            "inputs": [i.name for i in model.graph.input],
            "outputs": [o.name for o in model.graph.output],
            "num_layers": layers,
            "num_kv_heads": d.kv_heads,
            "head_dim": d.head_dim,
            "seq_lens": seq_lens,
        }
    info = {"block_size": d.block_size, "ctx_len": d.ctx_len, "prefill_seq_len": d.prefill_seq_len, "graphs": graphs}
    (dest / "export.json").write_text(json.dumps(info, indent=2), encoding="utf-8")
    return dest
