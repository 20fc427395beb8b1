"""Mixture-of-experts targets for QAIC: `compile.backend=qaic` writes the experts in standard ops (each token
gathers its chosen experts' weights: modeling/moe_gathered.py), every op on the QAIC list and every shape static
at the bundle's specializations. No card here: the QAIC graphs themselves are run by ONNX Runtime, and every
mode on them equals Hugging Face's `generate` (tiny random Qwen3-MoE, Qwen3.5-MoE and gpt-oss pairs). The targets
whose layers all keep a K/V cache are built for continuous batching too (compile.qaic.full_batch_size)."""

from __future__ import annotations

import json

import onnx
import pytest

from tests.engines import assert_every_mode_equals_hf, dflash_ok, mixed_prompts
from tests.fixtures.tiny_pairs import make_pair

NEW_TOKENS = 16
MODES = ("plain", "dflash", "lookup", "hybrid")
FULL = {"qwen3_moe": 3, "gpt_oss": 3}  # Qwen3.5-MoE's recurrent state is refused a full batch (test_qaic_slots.py)


@pytest.fixture(scope="module", params=["qwen3_moe", "qwen3_5_moe", "gpt_oss"])
def qaic_build(request, tmp_path_factory):
    """(pair, recipe path, cache dir, bundle dir) after `dflash compile --backend qaic --emit-script`."""
    root = tmp_path_factory.mktemp(f"qaic_{request.param}")
    pair = make_pair(root / "pair", request.param)
    qaic = {"backend": "qaic", "qaic": {"full_batch_size": FULL.get(request.param, 1)}}
    recipe = pair.write_recipe(root / "recipe.yaml", export={"logits": True}, compile=qaic)
    cache, bundle = root / "cache", root / "bundle"
    dflash_ok("compile", "-r", str(recipe), "--cache-dir", str(cache), "--emit-script", str(bundle))
    return pair, recipe, cache, bundle


def _export_dir(cache):
    return next(cache.glob("artifacts/export/*/export.json")).parent


@pytest.mark.slow
def test_experts_are_standard_ops_the_qaic_check_accepts(qaic_build) -> None:
    from dflash_cli.readiness import readiness_report

    _, _, cache, bundle = qaic_build
    onnx_file = next(p for p in (bundle / "target_cb.onnx", bundle / "target.onnx") if p.exists())
    target = onnx.load(str(onnx_file), load_external_data=False).graph
    assert not any(n.domain == "com.microsoft" for n in target.node)  # no MoE op: the card's compiler lacks it
    assert sum(n.op_type == "TopK" for n in target.node) >= 2  # the routing of every sparse layer, in the graph
    for graph in readiness_report(_export_dir(cache)).graphs:
        assert not graph.unsupported_ops and all(s.static for s in graph.shapes), graph
    specs = json.loads((bundle / "target" / "specializations.json").read_text())["specializations"]
    assert {s["name"] for s in specs} >= {"Prefill", "Decode"}


@pytest.mark.slow
def test_every_mode_on_the_qaic_graphs_equals_hf_generate(qaic_build) -> None:
    """The graphs QAIC gets, run by ONNX Runtime as a one-sequence static engine."""
    import torch
    from transformers import AutoModelForCausalLM

    from dflash_cli.cache.store import Cache
    from dflash_cli.decoding.engine import Artifacts, Engine
    from dflash_cli.recipe.schema import load_recipe
    from dflash_cli.stages.pipeline import artifact_path

    pair, recipe_path, cache, _ = qaic_build
    qaic = load_recipe(str(recipe_path))
    inject, export = artifact_path(qaic, Cache(cache), "inject"), _export_dir(cache)
    recipe = load_recipe(str(recipe_path), ["compile.backend=ort", "compile.ort.prefix_cache=false"])
    engine = Engine(recipe, Artifacts(inject, export, export, {}))
    assert type(engine.target).__name__ == "OrtSession"
    hf = AutoModelForCausalLM.from_pretrained(str(pair.target_dir), dtype=torch.float32).eval()
    prompts = mixed_prompts(hf.config.vocab_size, n=12)
    assert_every_mode_equals_hf({"qaic graphs": engine}, hf, prompts, NEW_TOKENS, MODES)


@pytest.mark.slow
def test_slot_graphs_batch_calls_and_change_no_sequence(qaic_build) -> None:
    """Continuous batching: QaicSlots over the "_cb" target program (emulated by ONNX Runtime), where a call's
    tokens gather their experts row by row, gives each sequence what it gets alone."""
    from dflash_cli.backends.batch_invariance import check_target
    from dflash_cli.qaic.slots import QaicSlots
    from dflash_cli.recipe.schema import load_recipe
    from tests.qaic_emulation import EmulatedProgram

    pair, recipe_path, cache, bundle = qaic_build
    full = FULL.get(pair.family)
    info = json.loads((_export_dir(cache) / "export.json").read_text())
    if full is None:
        assert "target_cb" not in info["graphs"]
        return
    graph = info["graphs"]["target_cb"]
    assert graph["full_batch_size"] == full and "batch_index" in graph["inputs"]
    program = EmulatedProgram(_export_dir(cache) / "target_cb.onnx", full, list(graph["seq_lens"].values()))
    export = load_recipe(str(recipe_path)).export
    found = check_target(QaicSlots(program, full, export.ctx_len, export.prefill_seq_len), info["block_size"], 64)
    assert found["equal"], found
    assert full in program.batches  # verify blocks and one-token steps went together, padded to every slot
    assert "target_cb.onnx" in (bundle / "compile.sh").read_text()
