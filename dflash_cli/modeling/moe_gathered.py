"""Mixture-of-experts MLPs in standard ONNX ops, for a compiler without ONNX Runtime's MoE op (QAIC).

The same `dflash::moe` (modeling/moe.py) translated another way: every (token, chosen expert) pair gathers
that expert's weights from the stacked tensors and multiplies its own row by them (Gather, batched MatMul),
the form QEfficient gives its MoE models for the card. Only the chosen experts' weights are read, every row
is computed on its own (a token's output does not depend on what shares its call), and every op is on the
QAIC list (readiness/qaic_ops_allowlist.txt: no ReduceSum, no Clip, no Gemm). The cost: a call of T tokens gathers
T * k expert matrices, so a long prefill chunk moves far more bytes than it multiplies; the prefill
specialization's length (export.prefill_seq_len) bounds it.
"""

from __future__ import annotations

import torch

from dflash_cli.modeling.moe import by_token


def onnx_translations() -> dict:
    from onnxscript import opset18 as op

    def translate(x, logits, gate_up, down, gate_up_bias, down_bias, k: int, renormalize: bool, act: list[float]):
        probs = op.Softmax(by_token(x, logits), axis=-1)
        top, chosen = op.TopK(probs, op.Constant(value_ints=[k]), axis=-1)
        if renormalize:  # the sum over k as a MatMul with ones (ReduceSum is not on the QAIC list)
            ones = op.CastLike(op.Constant(value_floats=[1.0] * k), top)
            top = op.Div(top, op.MatMul(top, op.Reshape(ones, op.Constant(value_ints=[k, 1]))))
        tokens, width = op.Shape(x, start=0, end=1), op.Shape(x, start=1, end=2)
        slots = op.Constant(value_ints=[k])
        experts = op.Reshape(chosen, op.Constant(value_ints=[-1]))  # row (token, slot), token-major
        rows = op.Expand(op.Unsqueeze(x, op.Constant(value_ints=[1])), op.Concat(tokens, slots, width, axis=0))
        column = op.Concat(op.Constant(value_ints=[-1]), width, op.Constant(value_ints=[1]), axis=0)
        rows = op.Reshape(rows, column)  # [T * k, hidden, 1]: each row a column for its expert's MatMul
        gu = op.Squeeze(op.MatMul(op.Gather(gate_up, experts, axis=0), rows), op.Constant(value_ints=[-1]))
        if gate_up_bias is not None:
            gu = op.Add(gu, op.Gather(gate_up_bias, experts, axis=0))
        alpha, beta, limit = act
        one, two, big = op.Constant(value_ints=[1]), op.Constant(value_ints=[2]), op.Constant(value_ints=[1 << 30])
        g = op.Slice(gu, op.Constant(value_ints=[0]), big, one, two)  # gate and up rows alternate
        u = op.Slice(gu, one, big, one, two)
        if limit != float("inf"):  # clamps as Where: the export's rewriter fuses Min/Max into Clip, not on the list
            cap, floor = (
                op.CastLike(op.Constant(value_float=limit), gu),
                op.CastLike(op.Constant(value_float=-limit), gu),
            )
            g = op.Where(op.Greater(g, cap), cap, g)
            u = op.Where(op.Greater(u, cap), cap, op.Where(op.Less(u, floor), floor, u))
        gated = op.Sigmoid(g) if alpha == 1.0 else op.Sigmoid(op.Mul(g, op.CastLike(op.Constant(value_float=alpha), g)))
        if beta != 0.0:
            u = op.Add(u, op.CastLike(op.Constant(value_float=beta), u))
        h = op.Mul(op.Mul(g, gated), u)
        y = op.MatMul(op.Gather(down, experts, axis=0), op.Unsqueeze(h, op.Constant(value_ints=[-1])))
        y = op.Squeeze(y, op.Constant(value_ints=[-1]))
        if down_bias is not None:
            y = op.Add(y, op.Gather(down_bias, experts, axis=0))
        per_slot = op.Mul(
            op.Reshape(y, op.Concat(tokens, slots, width, axis=0)), op.Unsqueeze(top, op.Constant(value_ints=[-1]))
        )
        parts = op.Split(per_slot, axis=1, num_outputs=k) if k > 1 else (per_slot,)
        total = parts[0]
        for part in parts[1:]:  # in slot order, as the PyTorch op sums them
            total = op.Add(total, part)
        return op.Squeeze(total, op.Constant(value_ints=[1]))

    return {torch.ops.dflash.moe.default: translate}
