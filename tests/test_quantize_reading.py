"""How the int4/int8 compile reads weights: transposed by PyTorch from a memory map, prefetched ahead."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from onnx import TensorProto

from dflash_cli.exporting.onnx_data import prefetch, read_initializer
from dflash_cli.ortcompile.quantize import _external_tensor, _transposed


def _stored(tmp_path: Path, w: np.ndarray):
    pad = np.zeros(3, dtype=w.dtype)  # a weight that starts mid-file, as in a real .data file
    (tmp_path / "w.data").write_bytes(pad.tobytes() + w.tobytes())
    dtype = TensorProto.FLOAT if w.dtype == np.float32 else TensorProto.FLOAT16
    return _external_tensor("w", dtype, w.shape, "w.data", pad.nbytes, w.nbytes)


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_transposed_memory_map_equals_numpy(tmp_path: Path, dtype) -> None:
    w = np.random.default_rng(0).standard_normal((301, 67)).astype(dtype)
    mapped = read_initializer(_stored(tmp_path, w), tmp_path)
    kn = _transposed(mapped)
    assert kn.dtype == dtype and kn.flags.c_contiguous
    np.testing.assert_array_equal(kn, w.T)


def test_prefetch_is_advice_only(tmp_path: Path) -> None:
    w = np.arange(12, dtype=np.float32).reshape(3, 4)
    tensor = _stored(tmp_path, w)
    prefetch(tensor, tmp_path)  # starts a read; the values are unchanged
    np.testing.assert_array_equal(read_initializer(tensor, tmp_path), w)
    (tmp_path / "w.data").unlink()
    prefetch(tensor, tmp_path)  # a missing file is the read's to report, not the prefetch's


def test_two_halves_quantise_to_exactly_the_whole(monkeypatch) -> None:
    from dflash_cli.ortcompile import quantize

    w = np.random.default_rng(1).standard_normal((96, 64)).astype(np.float32)  # [N, K]
    whole = quantize._quantize(np.ascontiguousarray(w.T), 4, 32)
    monkeypatch.setattr(quantize, "SPLIT_ROWS", 16)  # N = 96 >= 2 x 16: split
    halves = quantize._quantize_rows(w, 4, 32)
    for a, b in zip(whole, halves):
        np.testing.assert_array_equal(a, b)
