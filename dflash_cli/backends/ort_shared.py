"""Embedding tables served to ONNX Runtime from a memory map, one mapping per stored tensor.

The draft's embedding is the target's tensor (both graphs point at the same bytes of
target.onnx.data). Handing ONNX Runtime one memory-mapped OrtValue for it, in both sessions,
keeps one copy in memory instead of two, and only the rows a call gathers are ever paged in.
Only tables read by `Gather` (or its block-quantised form) qualify: weights of a MatMul get
transposed or pre-packed by the runtime, which copies them anyway.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from dflash_cli.exporting.onnx_data import external_info, read_initializer

GATHERS = {"Gather", "GatherBlockQuantized"}  # an int8/int4 build's embedding: its blocks and their scales


class SharedTables:
    def __init__(self) -> None:
        self._values: dict[tuple[str, int, int], tuple[Any, Any]] = {}  # keep each memmap alive with its OrtValue

    def for_graph(self, onnx_path: Path) -> dict[str, Any]:
        """Initializer name -> OrtValue for the graph's external tables that only Gather reads."""
        import onnx
        import onnxruntime as ort
        from onnx import TensorProto

        onnx_path = Path(onnx_path)
        model = onnx.load(str(onnx_path), load_external_data=False)
        readers: dict[str, set[str]] = {}
        for node in model.graph.node:
            for name in node.input:
                readers.setdefault(name, set()).add(node.op_type)
        out = {}
        for t in model.graph.initializer:
            if t.data_location != TensorProto.EXTERNAL or not readers.get(t.name, {"?"}) <= GATHERS:
                continue
            info = external_info(t)
            key = (
                os.path.realpath(onnx_path.parent / info["location"]),
                int(info.get("offset", 0)),
                int(info.get("length", 0)),
            )
            if key not in self._values:
                array = read_initializer(t, onnx_path.parent)
                self._values[key] = (array, ort.OrtValue.ortvalue_from_numpy(array))
            out[t.name] = self._values[key][1]
        return out

    @property
    def count(self) -> int:
        return len(self._values)
