"""Readiness: static shapes per specialization and ops against the allowlist, on tiny graphs."""

from __future__ import annotations

import json
from pathlib import Path

import onnx
import pytest

from dflash_cli.readiness import Report, check_graph, readiness_report
from dflash_cli.readiness.ops import ALLOWLIST_FILE, graph_ops, load_allowlist, parse_ops_file
from tests.qaic_graphs import build_target, with_local_function, write_export_dir


@pytest.fixture(autouse=True)
def _no_ops_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DFLASH_QAIC_OPS_FILE", raising=False)


def test_tiny_export_is_ready(tmp_path: Path) -> None:
    report = readiness_report(write_export_dir(tmp_path / "export"))
    assert report.ok, report.render_text()
    lines = report.render_text().splitlines()
    assert lines[:6] == [
        "target prefill (seq_len=8): static: yes; ops ok",
        "target verify (seq_len=4): static: yes; ops ok",
        "target: no fp16 hazards (mask constant, RoPE angles, unscaled RMSNorm square)",
        "draft prefill (seq_len=8): static: yes; ops ok",
        "draft decode (seq_len=4): static: yes; ops ok",
        "draft: no fp16 hazards (mask constant, RoPE angles, unscaled RMSNorm square)",
    ]
    data = json.loads(json.dumps(report.to_dict()))  # JSON-able
    assert data["ok"] is True and data["graphs"][0]["shapes"][0]["static"] is True
    assert "ScatterElements" in data["graphs"][0]["ops"]


def test_fp16_hazard_is_named_and_fails(tmp_path: Path) -> None:
    import numpy as np

    path = tmp_path / "target.onnx"
    onnx.save(build_target(mask_value=float(np.finfo(np.float32).min)), str(path))
    result = check_graph(path, {"prefill": 8})
    assert not result.ok and [h["kind"] for h in result.fp16_hazards] == ["mask-constant"]
    text = Report([result]).render_text()
    assert "target: fp16 hazard mask-constant x1" in text and "hint: use a finite mask value" in text


def test_unfixed_symbolic_dim_fails(tmp_path: Path) -> None:
    path = tmp_path / "target.onnx"
    onnx.save(build_target(batch_symbol="batch"), str(path))
    result = check_graph(path, {"prefill": 8, "verify": 4})
    assert not result.ok and result.unsupported_ops == []
    shapes = result.shapes[0]
    assert not shapes.static
    assert "input input_ids: [batch, 8]" in shapes.non_static
    text = Report([result]).render_text()
    assert "target prefill (seq_len=8): static: no (input input_ids: [batch, 8]" in text
    assert "readiness: FAIL" in text


def test_disallowed_op_fails(tmp_path: Path) -> None:
    path = tmp_path / "target.onnx"
    onnx.save(build_target(extra_op="NonZero"), str(path))
    result = check_graph(path, {"prefill": 8})
    assert result.unsupported_ops == ["NonZero"]
    assert any(s.startswith("nonzero_ids (NonZero)") for s in result.shapes[0].non_static)
    assert "unsupported ops: NonZero" in Report([result]).render_text()


def test_ops_inside_local_functions_are_checked(tmp_path: Path) -> None:
    model = with_local_function(build_target())
    ops = graph_ops(model)
    assert "ArgMax" in ops and "TokenArgMax" not in ops  # the call is not an op, its body is
    fn = model.functions[0]
    fn.node[0].op_type = "NonZero"
    fn.node[0].ClearField("attribute")
    assert "NonZero" in graph_ops(model)


def test_sdk_ops_file_replaces_allowlist(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "target.onnx"
    onnx.save(build_target(), str(path))
    sdk_list = tmp_path / "OnnxSupportedOperators.txt"
    sdk_list.write_text("# synthetic stand-in for the SDK's list\nMatMul\nAdd, opset 14\n")
    monkeypatch.setenv("DFLASH_QAIC_OPS_FILE", str(sdk_list))
    result = check_graph(path, {"prefill": 8})
    assert result.ops_source == str(sdk_list)
    assert "Gather" in result.unsupported_ops and "MatMul" not in result.unsupported_ops


def test_allowlist_file_documents_its_sources() -> None:
    text = ALLOWLIST_FILE.read_text()
    assert "-operators-supported=onnx" in text and "OnnxSupportedOperators.txt" in text
    allowed, source = load_allowlist()
    assert "not the SDK" in source
    reference_ops = set(
        "MatMul Add Mul Div Pow Sqrt Reciprocal ReduceMean Softmax Where ScatterND GatherND Gather GatherElements "
        "Expand Reshape Transpose Concat Slice Cast Range Unsqueeze Shape TopK CumSum ArgMax".split()
    )
    assert reference_ops <= allowed
    for line in text.splitlines():  # every op beyond the reference list says why and that it is unverified
        op = next(iter(parse_ops_file(line)), None)
        if op and op not in reference_ops:
            assert "added by dflash" in line and "not verified on QAIC" in line, line
    assert "NonZero" not in allowed


def test_parse_ops_file_is_lenient() -> None:
    assert parse_ops_file("Abs\n  Add  # comment\n# Mul\n\nCast,13\n") == {"Abs", "Add", "Cast"}
