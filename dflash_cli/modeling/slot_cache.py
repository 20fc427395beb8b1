"""Continuous batching on an accelerator, the QEfficient way: one retained cache for every slot.

A graph exported with `batch_index` keeps the K/V cache of `full_batch_size` sequences on the device,
[full_batch, kv_heads, ctx_len, head_dim], and a call carries any `batch_size` of them: row r of the call
is the sequence in cache slot batch_index[r, 0]. Each row's new K/V are scattered at (its slot, its
positions) only, and its attention reads its slot's rows, so a sequence computes exactly what the
one-sequence graph computes with that slot's cache; the others' slots are neither read nor written.
Padding rows (position -1) write the spare last slot, as in the one-sequence graph (layers.write_cache).
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class SlotRows(NamedTuple):
    """Where a call's rows live: passed to the layers in place of the positions tensor."""

    rows: torch.Tensor  # [b]: each row's slot in the full cache
    positions: torch.Tensor  # [b, s]


@torch.library.custom_op("dflash::scatter_slots", mutates_args=())
def scatter_slots(cache: torch.Tensor, rows: torch.Tensor, positions: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """cache [full_batch, kvh, C, d] with new [b, kvh, s, d] written at (rows[r], head, positions[r, t])."""
    heads = torch.arange(new.shape[1], device=new.device)
    return cache.index_put((rows[:, None, None], heads[None, :, None], positions[:, None, :]), new)


@scatter_slots.register_fake
def _(cache, rows, positions, new):
    return torch.empty_like(cache)


def read_rows(cache: torch.Tensor, where) -> torch.Tensor:
    """The call's own sequences' caches [b, kvh, C, d] (a Gather), or `cache` itself in a one-sequence graph."""
    return cache.index_select(0, where.rows) if isinstance(where, SlotRows) else cache


def onnx_translations() -> dict:
    """`dflash::scatter_slots` -> one ScatterND with indices [b, kvh, s, 3] (slot, head, position), each index
    expanded to a shape read off the inputs, so every shape is static once a specialization fixes b and s
    (the exporter's own index_put broadcasts through Max of shapes, which shape inference cannot resolve)."""
    from onnxscript import opset18 as op

    def translate(cache, rows, positions, new):
        b = op.Shape(rows, start=0, end=1)
        heads, s = op.Shape(new, start=1, end=2), op.Shape(positions, start=1, end=2)
        grid = op.Concat(b, heads, s, axis=0)
        slot = op.Expand(op.Unsqueeze(rows, op.Constant(value_ints=[1, 2])), grid)
        head = op.Range(op.Constant(value_int=0), op.Squeeze(heads), op.Constant(value_int=1))
        head = op.Expand(op.Unsqueeze(head, op.Constant(value_ints=[0, 2])), grid)
        pos = op.Expand(op.Unsqueeze(positions, op.Constant(value_ints=[1])), grid)
        last = op.Constant(value_ints=[-1])
        index = op.Concat(op.Unsqueeze(slot, last), op.Unsqueeze(head, last), op.Unsqueeze(pos, last), axis=-1)
        return op.ScatterND(cache, index, new)

    return {torch.ops.dflash.scatter_slots.default: translate}
