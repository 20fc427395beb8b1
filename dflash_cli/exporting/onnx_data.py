"""Reading ONNX initializers that live in external data files.

The `onnx` package refuses external data files with more than one hard link ("potential hardlink
attack"), and our cache hard-links data files between artifacts instead of copying them. These
helpers read the bytes themselves (memory-mapped), after checking the location stays inside the
graph's directory.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from dflash_cli.errors import DFlashError


def external_info(tensor) -> dict[str, str]:
    return {e.key: e.value for e in tensor.external_data}


def _data_path(base_dir: Path, location: str) -> Path:
    path = (base_dir / location).resolve()
    if path.parent != base_dir.resolve():
        raise DFlashError(f"external data {location!r} points outside {base_dir}", hint="rebuild the artifact")
    return path


def is_deferred(tensor) -> bool:
    """A lean export's checkpoint weight: no bytes in the export (external_data.DEFERRED)."""
    from onnx import TensorProto

    from dflash_cli.exporting.external_data import DEFERRED

    return tensor.data_location == TensorProto.EXTERNAL and external_info(tensor).get("location") == DEFERRED


def read_initializer(tensor, base_dir: Path) -> np.ndarray:
    """An initializer's values, memory-mapped when they live in an external file."""
    from onnx import TensorProto, helper, numpy_helper

    if tensor.data_location != TensorProto.EXTERNAL:
        return numpy_helper.to_array(tensor)
    if is_deferred(tensor):  # the source it was left out for could not give it (weight_sources.py)
        raise DFlashError(
            f"{tensor.name} is not in the export (an int8/int4 build reads it from the checkpoint), and the "
            "checkpoint file it was exported from has changed or is gone",
            hint="rebuild the export from the checkpoint as it is now: `dflash build --rebuild export`",
        )
    info = external_info(tensor)
    dtype = helper.tensor_dtype_to_np_dtype(tensor.data_type)
    count = int(np.prod(tensor.dims)) if tensor.dims else 1
    arr = np.memmap(
        _data_path(Path(base_dir), info["location"]),
        dtype=dtype,
        mode="r",
        offset=int(info.get("offset", 0)),
        shape=(count,),
    )
    return arr.reshape(tuple(tensor.dims))


def prefetch(tensor, base_dir: Path) -> None:
    """Ask the kernel to start reading an external initializer's bytes now (returns at once)."""
    from onnx import TensorProto

    if tensor.data_location == TensorProto.EXTERNAL:
        info = external_info(tensor)
        will_need(_data_path(Path(base_dir), info["location"]), int(info.get("offset", 0)), int(info.get("length", 0)))


def will_need(path, offset: int, length: int) -> None:
    """posix_fadvise(WILLNEED): the kernel reads the range in the background. Advice only: a missing
    file or a platform without it is the later read's to report."""
    import os

    if not hasattr(os, "posix_fadvise"):
        return
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.posix_fadvise(fd, offset, length, os.POSIX_FADV_WILLNEED)
    finally:
        os.close(fd)


def load_with_data(onnx_path: Path):
    """onnx.load with every external initializer read into the proto (for in-memory graph rewrites)."""
    import onnx
    from onnx import TensorProto

    onnx_path = Path(onnx_path)
    model = onnx.load(str(onnx_path), load_external_data=False)
    for t in model.graph.initializer:
        if t.data_location == TensorProto.EXTERNAL:
            data = np.ascontiguousarray(read_initializer(t, onnx_path.parent)).tobytes()
            del t.external_data[:]
            t.data_location = TensorProto.DEFAULT
            t.raw_data = data
    return model
