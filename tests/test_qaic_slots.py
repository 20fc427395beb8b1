"""QAIC continuous batching (compile.qaic.full_batch_size): the "_cb" graphs whose retained caches hold several
sequences, run here by ONNX Runtime: each sequence gets exactly what the one-sequence graph gives it, the other
slots stay untouched, the specializations and readiness cover them, and QaicSlots (qaic/slots.py) batches calls
over a program emulated on ONNX Runtime (no card here) without changing any sequence's outputs."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest

from dflash_cli.errors import RecipeError
from tests.qaic_emulation import EmulatedProgram

FULL = 3
PREFILL, CTX = 8, 64


@pytest.fixture(scope="module")
def export(tiny_qwen3_pair, tmp_path_factory) -> Path:
    from dflash_cli.cache.store import Cache
    from dflash_cli.recipe.schema import load_recipe
    from dflash_cli.stages.pipeline import artifact_path, build

    root = tmp_path_factory.mktemp("qaic_slots")
    qaic = {"backend": "qaic", "qaic": {"full_batch_size": FULL}}
    path = tiny_qwen3_pair.write_recipe(
        root / "r.yaml", export={"ctx_len": CTX, "prefill_seq_len": PREFILL}, compile=qaic
    )
    recipe, cache = load_recipe(str(path)), Cache(root / "cache")
    build(recipe, cache, upto="export")
    return artifact_path(recipe, cache, "export")


def _sessions(export: Path, graph: str):
    one = ort.InferenceSession(str(export / f"{graph}.onnx"), providers=["CPUExecutionProvider"])
    return one, ort.InferenceSession(str(export / f"{graph}_cb.onnx"), providers=["CPUExecutionProvider"])


def _call_feeds(graph: str, rng, starts: list[int], rows: int) -> dict[str, np.ndarray]:
    """A call for sequences filled to `starts`: the target takes `rows` tokens each; the draft a block of 4 after
    `rows` context rows each (the tiny pair's hidden size is 64)."""
    b = len(starts)
    if graph == "target":
        return {
            "input_ids": rng.integers(0, 60, (b, rows)),
            "position_ids": np.stack([np.arange(s, s + rows) for s in starts]),
        }
    return {
        "input_ids": rng.integers(0, 60, (b, 4)),
        "position_ids": np.stack([np.arange(s + rows, s + rows + 4) for s in starts]),
        "context_features": rng.standard_normal((b, rows, 64)).astype(np.float32),
        "context_position_ids": np.stack([np.arange(s, s + rows) for s in starts]),
    }


@pytest.mark.parametrize("graph", ["target", "draft"])
def test_each_sequence_gets_what_the_one_sequence_graph_gives_it(export: Path, graph: str) -> None:
    one, cb = _sessions(export, graph)
    kv = [i for i in one.get_inputs() if i.name.startswith("past_")]
    outs = [o.name for o in one.get_outputs() if not o.name.endswith("_RetainedState")]
    alone = [{i.name: np.zeros(i.shape, np.float32) for i in kv} for _ in range(FULL)]
    full = {i.name: np.zeros([FULL, *i.shape[1:]], np.float32) for i in kv}
    rng = np.random.default_rng(0)

    def call(sess, feeds, cache, rows=None):
        index = {"batch_index": np.asarray(rows, np.int64)[:, None]} if rows is not None else {}
        res = dict(zip([o.name for o in sess.get_outputs()], sess.run(None, {**feeds, **cache, **index})))
        return res, {n: res[n + "_RetainedState"] for n in cache}

    lens = [5, 8, 3]
    for slot, n in enumerate(lens):  # each slot filled alone, to a length of its own
        feeds = _call_feeds(graph, rng, [0], n)
        mine, alone[slot] = call(one, feeds, alone[slot])
        shared, full = call(cb, feeds, full, [slot])
        assert all(np.array_equal(mine[o], shared[o]) for o in outs)
    rows = [2, 0]  # slot 1 sits this call out
    feeds = _call_feeds(graph, rng, [lens[r] for r in rows], 2)
    together, after = call(cb, feeds, full, rows)
    for r, slot in enumerate(rows):
        mine, cache = call(one, {k: v[r : r + 1] for k, v in feeds.items()}, alone[slot])
        assert all(np.array_equal(mine[o], together[o][r : r + 1]) for o in outs), (graph, slot)
        assert all(np.array_equal(cache[n][0], after[n][slot]) for n in cache)
    assert all(np.array_equal(full[n][1], after[n][1]) for n in full)  # neither read nor written
    info = json.loads((export / "export.json").read_text())["graphs"][f"{graph}_cb"]
    assert info["full_batch_size"] == FULL and info["cache"] == "slots" and "batch_index" in info["inputs"]


def test_qaic_slots_batches_calls_and_changes_no_sequence(export: Path) -> None:
    from dflash_cli.backends.batch_invariance import check_target
    from dflash_cli.qaic.slots import QaicSlots

    info = json.loads((export / "export.json").read_text())
    program = EmulatedProgram(export / "target_cb.onnx", FULL, list(info["graphs"]["target_cb"]["seq_lens"].values()))
    slots = QaicSlots(program, FULL, CTX, PREFILL)
    found = check_target(slots, info["block_size"], 64)
    assert found["equal"], found
    assert FULL in program.batches  # verify blocks and one-token steps went together, padded to every slot
    assert program.batches.count(1) >= 3 * 4  # each sequence alone, and the prefill chunks one at a time


def test_specializations_readiness_and_bundle(export: Path, tmp_path: Path, monkeypatch) -> None:
    from dflash_cli.qaic.bundle import emit_bundle
    from dflash_cli.qaic.command import QaicCompileOptions
    from dflash_cli.readiness import readiness_report

    monkeypatch.setenv("DFLASH_QAIC_ROOT", str(tmp_path / "no-sdk-here"))
    report = readiness_report(export)
    for g in report.graphs:
        assert g.onnx.endswith("_cb.onnx") and not g.unsupported_ops
        assert all(not s.non_static and s.error is None for s in g.shapes), g.shapes
    bundle = emit_bundle(export, tmp_path / "bundle", QaicCompileOptions())
    spec = json.loads((bundle / "target" / "specializations.json").read_text())["specializations"]
    batches = {s["name"]: (s["symbols"]["batch_size"], s["symbols"]["seq_len"]) for s in spec}
    assert batches == {
        "Prefill": ("1", str(PREFILL)),
        "Verify": ("1", "4"),
        "Decode": ("1", "1"),
        f"Verifyx{FULL}": (str(FULL), "4"),
        f"Decodex{FULL}": (str(FULL), "1"),
    }
    assert "target_cb.onnx" in (bundle / "compile.sh").read_text()


def test_recipe_refuses_a_full_batch_for_a_target_with_recurrent_state(tiny_qwen3_pair, tmp_path: Path) -> None:
    from dflash_cli.recipe.schema import load_recipe
    from tests.fixtures.tiny_pairs import write_recipe

    path = write_recipe(tmp_path / "r.yaml", tiny_qwen3_pair.target_dir, tiny_qwen3_pair.draft_dir, "qwen3_5")
    with pytest.raises(RecipeError, match="full_batch_size"):
        load_recipe(str(path), ["compile.qaic.full_batch_size=2"])
    assert load_recipe(str(path), ["compile.qaic.full_batch_size=1"]).compile.qaic.full_batch_size == 1
