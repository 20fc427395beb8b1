"""Where each exported weight came from, so the int8/int4 compile can read the checkpoint instead.

The export writes the checkpoint's tensors converted to `export.dtype`: an fp32 export of a bf16
checkpoint is twice its bytes, and on an 8B target the quantiser read 32 GB of fp32 back from disk
(this machine's disk: ~100 MB/s, so most of a 9-minute compile). `weight_sources.json` in the export
artifact names, per graph initializer, the checkpoint file and key it was converted from, that
file's size and mtime when the export read it, and the conversion. The compile reads a weight there
when the file is unchanged and converts it the same way (PyTorch's `.to`, as the export did), so it
gets the very values the export holds from half the bytes; otherwise it reads the export's copy.
"""

from __future__ import annotations

import json
import os
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np

FILE = "weight_sources.json"
FORMAT = 1


def origin(path: Path, key: str, dtype: str, rows: int | None) -> dict[str, Any]:
    """The record of one exported weight: checkpoint `path`/`key`, converted to `dtype` (a torch dtype
    name), its first `rows` rows when given."""
    real = os.path.realpath(path)
    st = os.stat(real)
    offset, length = _span(real, st.st_size, st.st_mtime_ns, key)
    return {
        "file": real,
        "key": key,
        "dtype": dtype,
        "rows": rows,
        "size": st.st_size,
        "mtime_ns": st.st_mtime_ns,
        "offset": offset,
        "length": length,
    }


def stack_origin(store, key: str, dtype: str, slabs: int | None) -> dict[str, Any]:
    """The record of a weight the export assembles from several stored tensors (weights.Stack: a MoE
    layer's experts): the weight directory that assembles it, and the size and mtime of its files."""
    parts = store.stacks[key].parts
    files = {os.path.realpath(store.root / store.refs[p].file) for p in parts}
    stats = {f: [os.stat(f).st_size, os.stat(f).st_mtime_ns] for f in sorted(files)}
    return {"stack": key, "store": os.path.realpath(store.root), "dtype": dtype, "rows": slabs, "files": stats}


def write(out_dir: Path, per_graph: dict[str, dict[str, dict]]) -> None:
    """`per_graph`: onnx file name -> {initializer name: origin}."""
    (out_dir / FILE).write_text(json.dumps({"format": FORMAT, "graphs": per_graph}) + "\n")


class SourceReader:
    """Reads one graph's weights from the checkpoint they were exported from, where still unchanged."""

    def __init__(self, table: dict[str, dict]) -> None:
        self.table = table
        self.read_count = 0  # weights read from the checkpoint (the rest came from the export)

    @classmethod
    def for_graph(cls, export_dir: Path, onnx_name: str) -> SourceReader | None:
        try:
            data = json.loads((export_dir / FILE).read_text())
        except (OSError, ValueError):
            return None  # an export made before this file existed: the export's bytes are read
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            return None
        table = data.get("graphs", {}).get(onnx_name)
        return cls(table) if isinstance(table, dict) else None

    def _unchanged(self, name: str) -> dict | None:
        o = self.table.get(name)
        if o is None:
            return None
        files = o["files"].items() if "stack" in o else [(o["file"], [o["size"], o["mtime_ns"]])]
        try:
            stats = [(os.stat(f), want) for f, want in files]
        except OSError:
            return None
        return o if all([st.st_size, st.st_mtime_ns] == list(want) for st, want in stats) else None

    def slabs(self, tensor):
        """A stacked weight's slabs (experts) one at a time as the export wrote them, or None."""
        import torch

        from dflash_cli.checkpoints.weights import WeightStore
        from dflash_cli.errors import DFlashError

        o = self._unchanged(tensor.name)
        if o is None or "stack" not in o:
            return None
        try:
            store = WeightStore.open(Path(o["store"]))
        except (OSError, DFlashError):  # the inject artifact it was assembled by is gone: read the export
            return None
        if o["stack"] not in store.stacks or (o["rows"] or store.shape(o["stack"])[0]) != tensor.dims[0]:
            return None
        self.read_count += 1
        return (slab.numpy() for slab in store.iter_rows(o["stack"], getattr(torch, o["dtype"]), rows=o["rows"]))

    def prefetch(self, tensor) -> bool:
        """Start reading the tensor's checkpoint bytes; False when it will come from the export."""
        from dflash_cli.exporting.onnx_data import will_need

        o = self._unchanged(tensor.name)
        if o is None or "stack" in o:
            return o is not None
        will_need(o["file"], o["offset"], o["length"])
        return True

    def read(self, tensor) -> np.ndarray | None:
        """The initializer's values as the export wrote them, or None (then read the export's copy)."""
        import torch
        from safetensors import SafetensorError, safe_open

        o = self._unchanged(tensor.name)
        if o is None:
            return None
        if "stack" in o:
            slabs = self.slabs(tensor)
            return None if slabs is None else np.concatenate(list(slabs))
        try:
            with safe_open(o["file"], framework="pt", device="cpu") as f:
                part = f.get_slice(o["key"])
                values = part[: o["rows"]] if o["rows"] is not None else part[:]
        except (OSError, SafetensorError, KeyError):
            return None
        if tuple(values.shape) != tuple(tensor.dims):
            return None
        self.read_count += 1
        return values.to(getattr(torch, o["dtype"])).numpy()


@lru_cache(maxsize=64)
def _header(path: str, size: int, mtime_ns: int) -> tuple[int, dict]:
    from dflash_cli.checkpoints.locate import read_safetensors_header

    raw = read_safetensors_header(Path(path))
    return 8 + len(raw), json.loads(raw)


def _span(path: str, size: int, mtime_ns: int, key: str) -> tuple[int, int]:
    """Byte offset and length of `key`'s data in a safetensors file."""
    start, header = _header(path, size, mtime_ns)
    begin, end = header[key]["data_offsets"]
    return start + begin, end - begin
