"""Where a compile's quantised tensors go: appended to `<graph>.onnx.q.data` and named by external tensors."""

from __future__ import annotations

from pathlib import Path

import numpy as np

ALIGNMENT = 65536


class QuantStore:
    """Appends arrays to an open data file (a hashing writer), each large one aligned for memory mapping."""

    def __init__(self, file, data_name: str) -> None:
        self.file, self.data_name, self.offset = file, data_name, 0

    def write(self, base: str, packed: np.ndarray, scales: np.ndarray | None = None) -> tuple[list, list]:
        """Append the arrays (`scales` named base + ".scales"); returns their tensors and places."""
        from onnx import helper

        tensors, places = [], []
        for name, arr in ((base, packed), (base + ".scales", scales))[: 1 if scales is None else 2]:
            pad = (-self.offset) % ALIGNMENT if arr.nbytes > ALIGNMENT else 0
            self.file.write(b"\0" * pad)
            self.offset += pad
            self.file.write(np.ascontiguousarray(arr))  # a fresh array nothing changes afterwards
            dtype = helper.np_dtype_to_tensor_dtype(arr.dtype)
            place = (dtype, tuple(arr.shape), self.data_name, self.offset, arr.nbytes)
            tensors.append(external_tensor(name, *place))
            places.append((name, place))
            self.offset += arr.nbytes
        return tensors, places


def external_tensor(name: str, data_type: int, shape: tuple, location: str, offset: int, length: int):
    from onnx import TensorProto

    t = TensorProto(name=name, data_type=data_type)
    t.dims.extend(shape)
    t.data_location = TensorProto.EXTERNAL
    for key, value in (("location", location), ("offset", str(offset)), ("length", str(length))):
        e = t.external_data.add()
        e.key, e.value = key, value
    return t


def source_identity(weight, base_dir: Path, transposed: bool):
    """The stored bytes a weight initializer points at (file, offset, length), or None when inline."""
    import os

    from onnx import TensorProto

    from dflash_cli.exporting.onnx_data import external_info

    if weight.data_location != TensorProto.EXTERNAL:
        return None
    info = external_info(weight)
    where = os.path.realpath(base_dir / info["location"])
    return (where, int(info.get("offset", 0)), int(info.get("length", 0)), transposed)
