"""Gated DeltaNet states rolled back by position, like a KV cache: no explicit rollback call.

A call keeps, besides the states at its start (the base), each of its rows' delta-rule terms: the raw conv
input, k, the correction u and the log-gate g ("pending rows", tagged with their positions). The next call
starts at the first position the decoding loop did not reject, so it folds into the base exactly the
pending rows before its own start and drops the rest:

    S = exp(sum g') S_base + sum_j exp(sum_{i>j} g'_i) k'_j u_j^T     (g', k' zero on rows not folded)

u_j only depends on the rows up to j, so any prefix of a block folds exactly; the conv state after c
rows is the window's columns c .. c+K-2. Folding costs one [dk, R] x [R, dv] product per head; nothing
re-runs a token, and a rejected row costs nothing but its R-row slot. Kept per layer and call:
R x (conv_dim + Hv (dk + dv + 1)) values, against R x Hv x dk x dv for per-position states (Qwen3.5-9B,
R = 16: 1 MiB against 32 MiB per layer).

Where the caller keeps every row of a call (ONNX Runtime, `keep=None`) pending has the call's length; a
static graph (an accelerator's retained buffers) keeps a fixed `keep` rows: the last `keep` real rows
stay pending and the ones before are folded into the base within the call (a prefill chunk longer
than a verify block).
"""

from __future__ import annotations

import torch

from dflash_cli.modeling.delta_scan import delta_fold, delta_rows
from dflash_cli.modeling.gated_delta import GatedDeltaLayer, _intra_block


class RollbackDeltaLayer(GatedDeltaLayer):
    """GatedDeltaLayer whose call takes the base states and pending rows of the call before it.

    `row_by_row` (the variable-length graph ONNX Runtime runs): the recurrence and the fold run one row at a
    time (delta_scan.py), so a position's outputs and states do not depend on its call's length; else (the
    static graphs an accelerator compiles, where ONNX Scan is not an allowed op) in block form."""

    def __init__(self, config, squarings: int | None = None) -> None:
        super().__init__(config)
        self.squarings = squarings
        self.row_by_row = False

    @property
    def row_width(self) -> int:
        return self.conv_dim + self.v_heads * (self.dk + self.dv + 1)

    def empty_rows(self, batch: int, rows: int, dtype=torch.float32, device=None) -> torch.Tensor:
        return torch.zeros(batch, rows, self.row_width, dtype=dtype, device=device)

    def _unpack(self, rows: torch.Tensor):
        b, r, _ = rows.shape
        hv = self.v_heads
        qkv, k, u, g = rows.split([self.conv_dim, hv * self.dk, hv * self.dv, hv], dim=-1)
        k = k.reshape(b, r, hv, self.dk).transpose(1, 2)
        u = u.reshape(b, r, hv, self.dv).transpose(1, 2)
        return qkv, k, u, g.transpose(1, 2)

    def _pack(self, qkv, k, u, g) -> torch.Tensor:
        b, _, t, _ = k.shape
        flat = [y.transpose(1, 2).reshape(b, t, -1) for y in (k, u)]
        return torch.cat([qkv.float(), *flat, g.transpose(1, 2)], dim=-1)

    def _fold(self, conv, state, qkv, k, u, g, take):
        """(conv, state) after the rows `take` [B, R] (bool, a prefix of the rows) of (qkv, k, u, g)."""
        return self._fold_conv(conv, qkv, take), self._fold_state(state, k, u, g, take)

    def _fold_state(self, state, k, u, g, take):
        if self.row_by_row:
            return delta_fold(state, k, u, g, take)
        m = take[:, None, :]
        g = torch.where(m, g, 0.0)
        k = torch.where(m[..., None], k, 0.0)
        u = torch.where(m[..., None], u, 0.0)
        # Sums as the last entry of a CumSum (ReduceSum is not on the QAIC allow-list; CumSum is).
        cum = g.cumsum(-1)
        total = cum[..., -1:]  # [B, Hv, 1]
        after = total - cum  # per row: the gates of the folded rows after it (<= 0: exp stays within 1)
        return total.exp()[..., None] * state + (k * after.exp()[..., None]).transpose(-1, -2) @ u

    def _fold_conv(self, conv, qkv, take):
        """The conv state after the rows `take`: the window's columns count .. count+K-2."""
        count = take.to(torch.int64).cumsum(-1)[:, -1:]  # [B, 1]
        window = torch.cat([conv, qkv.transpose(1, 2).to(conv.dtype)], dim=-1)  # [B, conv_dim, K-1+R]
        idx = count + torch.arange(self.kernel - 1, device=conv.device)[None]  # [B, K-1]
        return window.gather(2, idx[:, None, :].expand(window.shape[0], window.shape[1], self.kernel - 1))

    def step(self, x, valid, fresh, commit, fold, pick, conv, state, rows):
        """One call. x [B, T, hidden]; valid [B, T] (real rows); fresh [B, 1] (the sequence's first call: the
        incoming states are ignored, whatever a device buffer held); commit [B, R_in] (pending rows to fold
        first); fold [B, T] (this call's rows folded into the base before returning, or None); pick [B, keep]
        (indices into this call's rows followed by `keep` padding rows: the rows kept pending, or None: all).

        Returns (y, conv, state, rows): the base states and pending rows the next call takes."""
        f = fresh[..., None]
        conv = torch.where(f, 0.0, conv)
        state = torch.where(f[..., None], 0.0, state)
        rows = torch.where(f, 0.0, rows)
        conv, state = self._fold(conv, state, *self._unpack(rows), commit)

        q, k, v, a, b, z, window = self._inputs(x, conv)
        if self.row_by_row:
            core, u, g = delta_rows(state, q, k, v, a, b, self.decay_rate(), valid)
        else:
            g, beta = self._gates(a, b, valid)
            cum, decay, w, y = _intra_block(k, v, g, beta, self.squarings)
            u = y - w @ state
            core = (q * cum.exp()[..., None]) @ state + ((q @ k.transpose(-1, -2)) * decay) @ u
        out = self._output(core, z, x.dtype)
        qkv = window[:, :, self.kernel - 1 :].transpose(1, 2)  # this call's raw conv inputs [B, T, conv_dim]
        new_rows = self._pack(qkv, k, u, g)
        if pick is None:
            return out, conv, state, new_rows
        conv, state = self._fold(conv, state, qkv, k, u, g, fold)
        padded = torch.cat([new_rows, new_rows.new_zeros(new_rows.shape[0], pick.shape[1], new_rows.shape[2])], 1)
        kept = padded.gather(1, pick[..., None].expand(pick.shape[0], pick.shape[1], padded.shape[2]))
        return out, conv, state, kept


def row_plan(positions: torch.Tensor, row_positions: torch.Tensor, keep: int | None):
    """What every linear layer of a call does with pending rows, from positions alone.

    positions [B, T] (the call's, -1 on padding); row_positions [B, R] (the pending rows', -1 on padding).
    Returns (valid, fresh, commit, fold, pick, kept_positions)."""
    start = positions[:, :1]
    fresh = start == 0
    valid = positions >= 0
    # Pending rows before the call's start (a padding row, -1, counts as at the start: never folded). At a
    # sequence's start (0) nothing is. One Where and one Less: And/Not are not on the QAIC allow-list.
    commit = torch.where(row_positions < 0, start, row_positions) < start
    if keep is None:  # every row stays pending (as a computed value: a graph output may not be an input)
        return valid, fresh, commit, None, None, torch.where(valid, positions, -1)
    row = valid.to(torch.int64).cumsum(-1)  # 1, 2, .. over the real rows (padding comes after them)
    real = row[:, -1:]
    first = torch.where(real > keep, real - keep, torch.zeros_like(real))  # rows before it are folded now
    fold = (positions * 0 + 1).cumsum(-1) <= first  # row numbers from 1, without a Range of the call's length
    pick = first + torch.arange(keep, device=positions.device)[None]  # [B, keep]
    padded = torch.cat([positions, torch.full_like(positions[:, :1], -1).expand(-1, keep)], dim=1)
    return valid, fresh, commit, fold, pick, padded.gather(1, pick)
