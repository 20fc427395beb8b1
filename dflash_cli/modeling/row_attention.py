"""Attention one query row at a time over exactly the slots it sees: the same numbers whatever the call's length.

Spelled out as matrix products over the call, a query row's scores, softmax and weighted sum of V run over
the call's whole key range (its later rows masked) in kernels chosen by the call's row count: ONNX Runtime's
MatMul for 64 rows sums a row's probs @ V in another order than for one row (2e-5 apart on the Qwen3.5-9B
shape). Here each row slices the keys it sees (slots 0 .. its position) and runs scores, softmax and
probs @ V on tensors of that row's shape alone, as a one-token call at that position does: bit-equal.

`dflash::row_attention` is a custom op: in PyTorch a loop over rows; exported, a node of the `dflash.delta`
domain that exporting/row_scans.py turns into an ONNX `Scan` over the rows. For the prefix-cache graphs of
one sequence (the keys are slot-major from position 0: a row at position p sees the first p + 1).
"""

from __future__ import annotations

import torch

from dflash_cli.modeling.delta_scan import DOMAIN


@torch.library.custom_op("dflash::row_attention", mutates_args=())
def row_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor, scale: float
) -> torch.Tensor:
    """q [b, h, s, d]; k, v [b, kvh, L, d] (slot j at position j); positions [b, s] (-1: padding, which attends
    slot 0 only, to stay finite) -> [b, h, s, d]."""
    b, h, s, d = q.shape
    kvh = k.shape[1]
    out = torch.empty_like(q)
    for i in range(b):
        for t in range(s):
            end = int(positions[i, t].clamp(min=0)) + 1
            qg = q[i, :, t].reshape(kvh, h // kvh, d)
            probs = torch.softmax((qg @ k[i, :, :end].transpose(-1, -2)) * scale, dim=-1)
            out[i, :, t] = (probs @ v[i, :, :end]).reshape(h, d)
    return out


@row_attention.register_fake
def _(q, k, v, positions, scale):
    return torch.empty_like(q)


def _register_schema() -> None:
    import onnx
    from onnx.defs import OpSchema

    try:
        onnx.defs.get_schema("RowAttention", 1, DOMAIN)
        return
    except onnx.defs.SchemaError:
        pass
    param = OpSchema.FormalParameter
    schema = OpSchema(
        "RowAttention",
        DOMAIN,
        1,
        inputs=[param("q", "T"), param("k", "T"), param("v", "T"), param("positions", "I")],
        outputs=[param("out", "T")],
        type_constraints=[("T", ["tensor(float)", "tensor(float16)"], ""), ("I", ["tensor(int64)"], "")],
        attributes=[OpSchema.Attribute("scale", OpSchema.AttrType.FLOAT, "")],
    )
    onnx.defs.register_schema(schema)


def onnx_translations() -> dict:
    import onnxscript

    _register_schema()
    ops = onnxscript.values.Opset(DOMAIN, 1)

    def translate(q, k, v, positions, scale: float):
        return ops.RowAttention(q, k, v, positions, scale=scale)

    return {torch.ops.dflash.row_attention.default: translate}
