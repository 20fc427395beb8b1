"""Tiny MoE pairs (Qwen3-MoE, gpt-oss, Qwen3-Next) through the command line at the quantised precisions: experts
as QMoE, `run --json` identical in every mode, `bench` lossless, each quantised expert stored once."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dflash_cli.exporting.onnx_data import is_deferred
from tests.engines import assert_quantised_runs_agree, dflash_ok
from tests.fixtures.tiny_pairs import make_pair


def _own_quantised(graph_path: Path) -> list[str]:
    """The weights a graph's quantised tensors file holds for it (not pointing at another graph's), by MatMul."""
    import re

    import onnx

    graph = onnx.load(str(graph_path), load_external_data=False).graph
    mine = ("location", f"{graph_path.name}.q.data")
    stored = [t.name for t in graph.initializer if mine in {(e.key, e.value) for e in t.external_data}]
    return sorted({re.sub(r"\.w\d+(\.scales)?$", "", n.removeprefix("inner.")) for n in stored})


@pytest.mark.slow
@pytest.mark.parametrize(
    "family,precision", [("qwen3_moe", "int8"), ("qwen3_moe", "int4"), ("gpt_oss", "int4"), ("qwen3_next", "int4")]
)
def test_quantised_moe_build_runs_and_benches_losslessly(family: str, precision: str, tmp_path: Path) -> None:
    import onnx

    pair = make_pair(tmp_path / "pair", family)
    recipe = str(pair.write_recipe(tmp_path / "recipe.yaml", compile={"ort": {"precision": precision}}))
    common = ["-r", recipe, "--cache-dir", str(tmp_path / "cache")]
    dflash_ok("build", *common)
    compile_dir = next((tmp_path / "cache" / "artifacts" / "compile").glob("*/"))
    facts = json.loads((compile_dir / "compile.json").read_text())
    assert facts["target_quantized_moe_layers"] == facts["target_prefix_quantized_moe_layers"] == 4
    assert facts["prefix_call_length_max_diff"]["tokens"] == 0.0
    # it points at target's experts; a shared expert's projections, fused with the router's (one MatMul reading the
    # same rows), are a new tensor each graph quantises for itself
    own = _own_quantised(compile_dir / "target_prefix.onnx")
    shared_expert = family == "qwen3_next"
    assert bool(own) == shared_expert and all(n.endswith(".mlp.gate.weight+3") for n in own), own
    # a lean export: the experts and every other checkpoint weight are read from the checkpoint, never stored twice
    export_dir = next((tmp_path / "cache" / "artifacts" / "export").glob("*/"))
    origins = json.loads((export_dir / "weight_sources.json").read_text())["graphs"]["target.onnx"]
    exported = onnx.load(str(export_dir / "target.onnx"), load_external_data=False).graph.initializer
    assert any(origins[t.name].get("stack") for t in exported if t.name in origins)  # the experts among them
    assert all(is_deferred(t) for t in exported if t.name in origins and t.external_data)  # small ones sit inline
    graph = onnx.load(str(compile_dir / "target_prefix.onnx"), load_external_data=False).graph
    qmoe = [n for n in graph.node if n.op_type == "QMoE"]
    assert len(qmoe) == 4 and not any(n.op_type == "MoE" for n in graph.node)
    bits = {a.i for n in qmoe for a in n.attribute if a.name == "expert_weight_bits"}
    assert bits == {int(precision[3:])}

    doc = assert_quantised_runs_agree(common, tmp_path / "prompts.jsonl")
    dec = doc["decomposition"]  # the verify-cost curve up to the block (4 here) and the break-even tau
    assert set(dec["t_verify_curve_s"]) == {"1", "2", "4"} and dec["verify_cost_ratio"]["1"] == 1.0
    assert dec["break_even_tau"] == (dec["t_verify_s"] + dec["t_draft_s"]) / dec["t1_s"]
    curve = dec["t_verify_curve_s"]
    assert dec["verify_row_s"] == (curve["4"] - curve["1"]) / 3  # one more verify row, and its rate
    assert dec["target_macs_per_row"] > 0 and dec["verify_row_gops"] != 0
    # the draft's prefix graph takes fewer rows: a step drafting and verifying 2 of the 4 breaks even lower
    assert set(dec["t_draft_curve_s"]) == {"2", "4"} and dec["t_draft_curve_s"]["4"] == dec["t_draft_s"]
    assert dec["break_even_tau_by_rows"]["4"] == dec["break_even_tau"]
    # the whole block drafted, 1 proposal asked for (graph revision 15), then 2 verified
    assert (
        set(dec["t_draft_proposals_curve_s"]) == {"2", "4"}
        and dec["break_even_tau_by_verify"]["4"] == dec["break_even_tau"]
    )
    text = dflash_ok("bench", *common, "--dataset", str(tmp_path / "prompts.jsonl"), "--max-new-tokens", "8").stdout
    assert "verify cost T(n)/T(1)" in text and "break-even tau" in text and "rows drafted+verified" in text
    assert "n verified, n-1 proposed" in text and "verify row (T(B)-T(1))/(B-1)" in text
