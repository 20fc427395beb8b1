"""specializations.json, custom_io.yaml and export.json reading, against golden files."""

from __future__ import annotations

import json
from pathlib import Path

import onnx
import pytest
import yaml

from dflash_cli.errors import BackendError, CacheError
from dflash_cli.qaic.specs import (
    custom_io_yaml,
    kv_io_names,
    onnx_dim_params,
    onnx_has_local_functions,
    read_export_json,
    specializations,
    write_graph_inputs,
)
from tests.qaic_golden import assert_golden
from tests.qaic_graphs import TinyDims, build_target, with_local_function, write_export_dir


@pytest.fixture(scope="module")
def export_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_export_dir(tmp_path_factory.mktemp("export"))


def _dump(spec: dict) -> str:
    return json.dumps(spec, indent=2) + "\n"


def test_specializations_from_export(export_dir: Path) -> None:
    info = read_export_json(export_dir)
    for graph in ("target", "draft"):
        params = onnx_dim_params(export_dir / f"{graph}.onnx")
        assert params == {"seq_len"}  # only seq_len is symbolic in the contract
        spec = specializations(info["graphs"][graph], params, ctx_len=info["ctx_len"])
        assert_golden(f"specializations_{graph}.json", _dump(spec))
    target = specializations(info["graphs"]["target"], {"seq_len"}, ctx_len=16)
    assert [s["name"] for s in target["specializations"]] == ["Prefill", "Verify"]
    assert target["specializations"][0]["symbols"] == {"seq_len": "8"}  # strings, only seq_len


def test_specializations_legacy_and_other_symbols(export_dir: Path) -> None:
    graph = read_export_json(export_dir)["graphs"]["draft"]
    legacy = specializations(graph, {"seq_len"}, ctx_len=16, fmt="legacy")
    assert_golden("specializations_draft_legacy.json", _dump(legacy))
    full = specializations(graph, {"seq_len", "ctx_len", "batch_size"}, ctx_len=16)
    assert full["specializations"][1] == {
        "name": "Decode",
        "symbols": {"batch_size": "1", "seq_len": "4", "ctx_len": "16"},
    }


def test_equal_specializations_collapse() -> None:
    graph = {"onnx": "target.onnx", "seq_lens": {"prefill": 16, "verify": 16}}
    assert len(specializations(graph, {"seq_len"}, ctx_len=64)["specializations"]) == 1


def test_unknown_symbol_is_an_error() -> None:
    graph = {"onnx": "target.onnx", "seq_lens": {"prefill": 8}}
    with pytest.raises(BackendError, match="past_len"):
        specializations(graph, {"seq_len", "past_len"}, ctx_len=16)


def test_custom_io_lists_every_kv_input_and_output(export_dir: Path) -> None:
    info = read_export_json(export_dir)
    target = info["graphs"]["target"]
    text = custom_io_yaml(target, "float16")
    assert_golden("custom_io_target_float16.yaml", text)
    assert_golden("custom_io_draft_mxint8.yaml", custom_io_yaml(info["graphs"]["draft"], "mxint8"))
    entries = yaml.safe_load(text)
    names = [e["IOName"] for e in entries]
    assert names == kv_io_names(target)
    assert len(names) == 4 * 2  # 2 layers x key/value x input/output
    assert {e["Precision"] for e in entries} == {"float16"}
    assert "past_value.1_RetainedState" in names and "input_ids" not in names
    with pytest.raises(ValueError):
        custom_io_yaml(target, "float32")  # type: ignore[arg-type]


def test_write_graph_inputs(export_dir: Path, tmp_path: Path) -> None:
    info = read_export_json(export_dir)
    files = write_graph_inputs(
        info["graphs"]["target"],
        export_dir / "target.onnx",
        tmp_path / "t",
        ctx_len=16,
        kv_precision="float16",
        num_devices=1,
        num_cores=16,
    )
    assert set(files) == {"specializations", "custom_io"}
    multi = write_graph_inputs(
        info["graphs"]["target"],
        export_dir / "target.onnx",
        tmp_path / "m",
        ctx_len=16,
        kv_precision="float16",
        num_devices=2,
        num_cores=16,
    )
    assert json.loads(multi["partition"].read_text())["partitions"][0]["devices"][1] == {"deviceId": 1, "numCores": 16}


def test_local_function_detection(tmp_path: Path) -> None:
    onnx.save(build_target(), str(tmp_path / "plain.onnx"))
    onnx.save(with_local_function(build_target()), str(tmp_path / "fn.onnx"))
    assert not onnx_has_local_functions(tmp_path / "plain.onnx")
    assert onnx_has_local_functions(tmp_path / "fn.onnx")


def test_export_json_problems(tmp_path: Path) -> None:
    with pytest.raises(CacheError, match="export.json"):
        read_export_json(tmp_path)
    write_export_dir(tmp_path / "bad", TinyDims(block_size=4, prefill_seq_len=6))
    with pytest.raises(CacheError, match="multiple of block_size"):
        read_export_json(tmp_path / "bad")
