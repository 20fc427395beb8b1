"""The delta rule one position at a time: the same operations in the same order whatever the call's length.

The block (matrix) form of modeling/gated_delta.py sums a position's terms in an order that depends on how
many rows share its call, so a verify row and a one-token call differ in the last bits. Here each row runs

    S' = exp(g) S,    u = beta (v - S'^T k),    S = S' + k u^T,    o = S^T q

on tensors of one row's shape ([B, Hv, d]), so a row computes exactly what a one-token call computes from
the same state. Folding accepted rows into the state at the next call (delta_rollback.py) repeats the update
`S = exp(g) S + k u^T` with the stored k, u, g, the same operations again: the state after n accepted rows
of a verify equals the state after n one-token calls, bit for bit.

Two custom ops carry this through export: `dflash::delta_rows` (a call's rows) and `dflash::delta_fold`
(pending rows into the state). In PyTorch they loop over the rows; exported, each is first a node of the
`dflash.delta` domain and then becomes an ONNX `Scan` over the row axis (`expand_scans`), which ONNX
Runtime runs at ~0.33 ms a row for a Qwen3.5-9B layer (32 heads of 128 x 128).
"""

from __future__ import annotations

import torch

DOMAIN = "dflash.delta"


def row_gates(a: torch.Tensor, b: torch.Tensor, rate: torch.Tensor, valid: torch.Tensor):
    """One row's (g, beta) [B, Hv] from its gate inputs a, b [B, Hv]; a padding row (valid [B] False) gets 0, 0.
    Per row, as softplus and sigmoid round an entry differently where a vectorised kernel reaches it in its
    scalar tail, which depends on how many rows share the tensor (tiny pairs with 6 value heads)."""
    g, beta = rate * torch.nn.functional.softplus(a), torch.sigmoid(b)
    return torch.where(valid[:, None], g, 0.0), torch.where(valid[:, None], beta, 0.0)


@torch.library.custom_op("dflash::delta_rows", mutates_args=())
def delta_rows(
    state: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    rate: torch.Tensor,
    valid: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """state [B, Hv, dk, dv]; q, k [B, Hv, T, dk]; v [B, Hv, T, dv]; a, b [B, Hv, T] (the gates' inputs); rate
    [Hv] (-exp(A_log)); valid [B, T] -> (o [B, Hv, T, dv], u [B, Hv, T, dv], g [B, Hv, T]): each row's output,
    delta-rule correction and log-gate."""
    outs, us, gs = [], [], []
    for t in range(q.shape[2]):
        g, beta = row_gates(a[:, :, t], b[:, :, t], rate, valid[:, t])
        decayed = state * g.exp()[..., None, None]
        u = (v[:, :, t] - (k[:, :, t, None, :] @ decayed)[:, :, 0]) * beta[..., None]
        state = decayed + k[:, :, t, :, None] * u[:, :, None, :]
        outs.append((q[:, :, t, None, :] @ state)[:, :, 0])
        us.append(u)
        gs.append(g)
    return torch.stack(outs, 2), torch.stack(us, 2), torch.stack(gs, 2)


@delta_rows.register_fake
def _(state, q, k, v, a, b, rate, valid):
    return torch.empty_like(v), torch.empty_like(v), torch.empty_like(a)


@torch.library.custom_op("dflash::delta_fold", mutates_args=())
def delta_fold(
    state: torch.Tensor, k: torch.Tensor, u: torch.Tensor, g: torch.Tensor, take: torch.Tensor
) -> torch.Tensor:
    """state [B, Hv, dk, dv] after the rows `take` [B, R] (bool) of k [B, Hv, R, dk], u [B, Hv, R, dv], g [B, Hv, R],
    in row order; a row not taken leaves the state as it was."""
    for r in range(k.shape[2]):
        folded = state * g[:, :, r].exp()[..., None, None] + k[:, :, r, :, None] * u[:, :, r, None, :]
        state = torch.where(take[:, r, None, None, None], folded, state)
    return state


@delta_fold.register_fake
def _(state, k, u, g, take):
    return torch.empty_like(state)


def _register_schemas() -> None:
    """The exporter's builder needs a schema to emit a node; the nodes only live until `expand_scans`."""
    import onnx
    from onnx.defs import OpSchema

    param = OpSchema.FormalParameter
    ops = {
        "DeltaRows": (["state", "q", "k", "v", "a", "b", "rate", "valid"], ["o", "u", "g"]),
        "DeltaFold": (["state", "k", "u", "g", "take"], ["state_out"]),
    }
    for name, (ins, outs) in ops.items():
        try:
            onnx.defs.get_schema(name, 1, DOMAIN)
            continue
        except onnx.defs.SchemaError:
            pass
        types = [("T", ["tensor(float)"], ""), ("B", ["tensor(bool)"], "")]
        schema = OpSchema(
            name,
            DOMAIN,
            1,
            inputs=[param(n, "B" if n in ("take", "valid") else "T") for n in ins],
            outputs=[param(n, "T") for n in outs],
            type_constraints=types,
        )
        onnx.defs.register_schema(schema)


def onnx_translations() -> dict:
    import onnxscript

    _register_schemas()
    delta = onnxscript.values.Opset(DOMAIN, 1)

    def rows(state, q, k, v, a, b, rate, valid):
        return delta.DeltaRows(state, q, k, v, a, b, rate, valid)

    def fold(state, k, u, g, take):
        return delta.DeltaFold(state, k, u, g, take)

    return {torch.ops.dflash.delta_rows.default: rows, torch.ops.dflash.delta_fold.default: fold}
