"""How the int4/int8 compile reads weights: transposed by PyTorch from a memory map, prefetched ahead."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from onnx import TensorProto

from dflash_cli.exporting.onnx_data import prefetch, read_initializer
from dflash_cli.ortcompile.quantize_store import external_tensor as _external_tensor
from dflash_cli.ortcompile.transpose import transposed as _transposed

pytestmark = pytest.mark.slow  # builds or exports pairs: left out of `make test-fast`


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
    from dflash_cli.ortcompile import quantize_forms as quantize

    w = np.random.default_rng(1).standard_normal((96, 64)).astype(np.float32)  # [N, K]
    whole = quantize.quantize_kn(np.ascontiguousarray(w.T), 4, 32)
    monkeypatch.setattr(quantize, "SPLIT_ROWS", 16)  # N = 96 >= 2 x 16: split
    halves = quantize.quantize_rows(w, 4, 32)
    for a, b in zip(whole, halves):
        np.testing.assert_array_equal(a, b)


def test_source_reader_reads_the_checkpoint_only_while_unchanged(tmp_path: Path) -> None:
    import os

    import torch
    from safetensors.torch import save_file

    from dflash_cli.exporting.weight_sources import SourceReader, origin

    w = torch.randn(40, 8).to(torch.bfloat16)
    save_file({"a": torch.zeros(3), "w": w}, str(tmp_path / "m.safetensors"))
    o = origin(tmp_path / "m.safetensors", "w", "float32", 24)
    raw = (tmp_path / "m.safetensors").read_bytes()
    assert raw[o["offset"] : o["offset"] + o["length"]] == w.view(torch.int16).numpy().tobytes()
    tensor = _external_tensor("inner.w", TensorProto.FLOAT, (24, 8), "x.data", 0, 24 * 8 * 4)
    reader = SourceReader({"inner.w": o})
    assert reader.prefetch(tensor)
    np.testing.assert_array_equal(reader.read(tensor), w[:24].float().numpy())  # as the export converts it
    assert reader.read_count == 1
    os.utime(tmp_path / "m.safetensors", ns=(o["mtime_ns"] + 10**9, o["mtime_ns"] + 10**9))
    assert reader.read(tensor) is None and not reader.prefetch(tensor)  # changed since: the export's copy


def _compiled_weights(compile_dir: Path) -> dict[str, dict[str, np.ndarray]]:
    """Every initializer of every compiled graph, by graph and name, wherever its bytes live."""
    import onnx

    out = {}
    for path in sorted(compile_dir.glob("*.onnx")):
        model = onnx.load(str(path), load_external_data=False)
        out[path.name] = {t.name: np.array(read_initializer(t, compile_dir)) for t in model.graph.initializer}
    return out


def _export_bytes(export_dir: Path) -> int:
    return sum(p.stat().st_size for p in export_dir.glob("*.data"))


@pytest.mark.parametrize("family", ["llama"])
def test_lean_int4_equals_int4_from_a_full_export(family: str, request, tmp_path: Path, monkeypatch):
    """A lean export (export.weights auto: no checkpoint weights written) compiles to the very tensors a
    full export does, read from the checkpoint; the full export compiled without the checkpoint too."""
    import json

    from dflash_cli.exporting import weight_sources
    from dflash_cli.stages.pipeline import artifact_paths
    from tests.engines import build_recipe

    pair = request.getfixturevalue(f"tiny_{family}_pair")
    settings = {"compile": {"ort": {"precision": "int4", "block_size": 16}}}
    recipe, cache = build_recipe(pair, tmp_path / "lean", **settings)
    lean = artifact_paths(recipe, cache, ["export", "compile"])
    facts = json.loads((lean["compile"] / "compile.json").read_text())
    assert facts["target_weights_read_from_checkpoint"] > 0 and facts["draft_weights_read_from_checkpoint"] > 0
    assert json.loads((lean["export"] / "export.json").read_text())["lean"] is True
    # the full build knows where its weights came from (which tables are checkpoint weights) but reads none there
    for method, value in (("read", None), ("slabs", None), ("prefetch", False)):
        monkeypatch.setattr(weight_sources.SourceReader, method, lambda self, tensor, v=value: v)
    settings["export"] = {"weights": "all"}
    recipe, cache = build_recipe(pair, tmp_path / "full", **settings)
    full = artifact_paths(recipe, cache, ["export", "compile"])
    assert json.loads((full["compile"] / "compile.json").read_text())["target_weights_read_from_checkpoint"] == 0
    # the lean export holds constants only (RoPE tables): a small part of the full one
    assert _export_bytes(lean["export"]) < _export_bytes(full["export"]) / 10
    a, b = _compiled_weights(lean["compile"]), _compiled_weights(full["compile"])
    assert a.keys() == b.keys()
    for graph in a:
        assert a[graph].keys() == b[graph].keys(), graph
        for name, values in a[graph].items():
            np.testing.assert_array_equal(values, b[graph][name], err_msg=f"{graph}: {name}")


def test_lean_export_with_a_changed_checkpoint_is_a_clear_error(tiny_llama_pair, tmp_path: Path) -> None:
    """The compile of a lean export reads the checkpoint. A changed checkpoint rebuilds the pipeline (its
    fingerprint moves); should the export be reused anyway, the quantiser refuses in one line that names the
    way out rather than read other values."""
    import json
    import os

    from dflash_cli.cache.store import Cache
    from dflash_cli.errors import DFlashError
    from dflash_cli.exporting.weight_sources import SourceReader
    from dflash_cli.ortcompile.quantize import quantize_graph
    from dflash_cli.recipe.schema import load_recipe
    from dflash_cli.stages.pipeline import artifact_paths, build

    path = tiny_llama_pair.write_recipe(tmp_path / "recipe.yaml", compile={"ort": {"precision": "int8"}})
    recipe, cache = load_recipe(str(path)), Cache(tmp_path / "cache")
    build(recipe, cache, upto="export")
    export = artifact_paths(recipe, cache, ["export"])["export"]
    table = json.loads((export / "weight_sources.json").read_text())["graphs"]
    for f in sorted({o["file"] for graph in table.values() for o in graph.values() if "file" in o}):
        st = os.stat(f)
        os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # the same bytes, but no longer provably so
    out = tmp_path / "compiled"
    out.mkdir()
    with pytest.raises(DFlashError) as exc:
        quantize_graph(
            export / "target.onnx", out / "target.onnx", bits=8, block_size=16,
            source=SourceReader.for_graph(export, "target.onnx"),
        )  # fmt: skip
    assert "not in the export" in str(exc.value) and "--rebuild export" in str(exc.value)
