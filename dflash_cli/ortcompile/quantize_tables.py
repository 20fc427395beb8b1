"""Embedding tables to ONNX Runtime's GatherBlockQuantized, for int8 / int4.

A Gather along the rows of a checkpoint's 2-D float table (the embedding; a vision tower's position
table) reads the table quantised block-wise along each row, with MatMulNBits' blocks and symmetric
zero point (2^(bits-1)), so a row dequantises to the values MatMulNBits would use. The exported
constants (the rotary tables) are never checkpoint weights and stay as they are. The fp32 embedding
was a quarter of an 8B int4 build's cache.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np

from dflash_cli.exporting.onnx_data import is_deferred, read_initializer


def quantize_tables(
    graph,
    inits: dict,
    write: Callable,
    src_dir: Path,
    *,
    bits: int,
    block_size: int,
    done: dict,
    identity: Callable,
    source,
    quantize_rows: Callable,
    external_tensor: Callable,
    progress: Callable[[str], None],
) -> tuple[dict[int, tuple], set[str]]:
    """{id(Gather node): (its GatherBlockQuantized, new tensors)} and the tables they replace. `done` shares a
    table quantised by an earlier graph (the draft reads the target's embedding)."""
    from onnx import helper

    out, tables = {}, set()
    for node in graph.node:
        table = inits.get(node.input[0]) if node.op_type == "Gather" else None
        if table is None or not _quantisable(node, table, block_size, source):
            continue
        key = ("gather", bits, block_size, identity(table))
        if key not in done:
            values = source.read(table) if source is not None else None
            values = read_initializer(table, src_dir) if values is None else values
            packed, scales = quantize_rows(np.asarray(values, np.float32), bits, block_size)
            dtype = helper.tensor_dtype_to_np_dtype(table.data_type)
            del values
            done[key] = write(f"{table.name}.g{bits}", packed.reshape(len(packed), -1), scales.astype(dtype))[1]
            del packed, scales
            progress(f"{table.name} to int{bits} (GatherBlockQuantized)")
        tensors = [external_tensor(name, *place) for name, place in done[key]]
        out[id(node)] = (_gather_node(node, tensors, bits, block_size), tensors)
        tables.add(table.name)
    return out, tables


def _quantisable(node, table, block_size: int, source) -> bool:
    """A Gather along rows of a 2-D float checkpoint weight whose rows split into whole blocks."""
    from onnx import TensorProto, helper

    axis = next((helper.get_attribute_value(a) for a in node.attribute if a.name == "axis"), 0)
    return (
        axis == 0
        and len(table.dims) == 2
        and table.dims[1] % block_size == 0
        and table.data_type in (TensorProto.FLOAT, TensorProto.FLOAT16)
        and (is_deferred(table) or (source is not None and table.name in source.table))
    )


def _gather_node(node, tensors, bits: int, block_size: int):
    from onnx import helper

    return helper.make_node(
        "GatherBlockQuantized",
        [tensors[0].name, node.input[1], tensors[1].name],
        list(node.output),
        name=(node.name or node.output[0]) + "_bq",
        domain="com.microsoft",
        gather_axis=0,
        quantize_axis=1,
        block_size=block_size,
        bits=bits,
    )
