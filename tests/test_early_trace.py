"""The export's early tracer (started before convert): the same graphs, used only when it traced
exactly what the export needs, and never needed for them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dflash_cli.exporting import early_trace, trace_worker
from tests.fixtures.tiny_pairs import TinyPair

FILES = [f"{g}.onnx{ext}" for g in ("target", "target_prefix", "draft", "draft_prefix") for ext in ("", ".data")]

pytestmark = pytest.mark.skipif(not trace_worker.usable(), reason="one core or no fork: nothing is traced ahead")


def _build(pair: TinyPair, root: Path, **build_args) -> Path:
    """Build the pair up to export in `root`; returns the export artifact."""
    from dflash_cli.cache import Cache
    from dflash_cli.pipeline import artifact_paths, build
    from dflash_cli.recipe import load_recipe

    recipe = load_recipe(str(pair.write_recipe(root / "recipe.yaml")))
    cache = Cache(root / "cache")
    build(recipe, cache, upto="export", **build_args)
    return artifact_paths(recipe, cache, ["export"])["export"]


def _traced_by(export: Path) -> set[str]:
    return {g["traced_by"] for g in json.loads((export / "export.json").read_text())["graphs"].values()}


def _same_graphs(a: Path, b: Path) -> None:
    for name in FILES:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name


@pytest.fixture(scope="module")
def reference(tiny_qwen3_pair: TinyPair, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The pair's graphs traced in the building process alone (no early tracer, no fork)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DFLASH_EXPORT_WORKERS", "0")
        export = _build(tiny_qwen3_pair, tmp_path_factory.mktemp("early_reference"))
    assert _traced_by(export) == {"this process"}
    return export


@pytest.fixture
def handles(monkeypatch) -> list:
    """Every EarlyTrace the builds start."""
    started, real = [], early_trace.EarlyTrace.start

    def start(recipe):
        handle = real(recipe)
        started.append(handle)
        return handle

    monkeypatch.setattr(early_trace.EarlyTrace, "start", staticmethod(start))
    return started


def test_a_build_traces_ahead_and_writes_the_same_graphs(reference, tiny_qwen3_pair, tmp_path, handles) -> None:
    export = _build(tiny_qwen3_pair, tmp_path)
    assert _traced_by(export) == {"early tracer"}
    _same_graphs(reference, export)
    (handle,) = handles
    assert not handle.skeleton.exists()  # its config-only copy of the pair is gone
    assert handle._worker is None  # and its child ended


def test_templates_of_other_settings_are_not_used(reference, tiny_qwen3_pair, tmp_path, monkeypatch) -> None:
    real = early_trace.EarlyTrace.start

    def start(recipe):  # as if the pair had changed between the early trace and the export
        handle = real(recipe)
        handle.signature = {**handle.signature, "pair": {**handle.signature["pair"], "block_size": 3}}
        return handle

    monkeypatch.setattr(early_trace.EarlyTrace, "start", staticmethod(start))
    export = _build(tiny_qwen3_pair, tmp_path)
    assert _traced_by(export) == {"forked tracer"}  # traced again, by the export's own child
    _same_graphs(reference, export)


def test_a_broken_early_tracer_changes_nothing(reference, tiny_qwen3_pair, tmp_path, monkeypatch) -> None:
    def broken(*args):
        raise RuntimeError("early tracer bug")

    monkeypatch.setattr(early_trace, "_setup", broken)  # fails in the child
    export = _build(tiny_qwen3_pair, tmp_path)
    assert _traced_by(export) == {"this process"}
    _same_graphs(reference, export)


def test_only_an_export_to_be_built_is_traced_ahead(tiny_qwen3_pair, tmp_path, handles) -> None:
    _build(tiny_qwen3_pair, tmp_path)
    assert len(handles) == 1
    _build(tiny_qwen3_pair, tmp_path)  # everything cached: nothing to trace
    assert len(handles) == 1
    export = _build(tiny_qwen3_pair, tmp_path, rebuild={"export"})
    assert len(handles) == 2 and _traced_by(export) == {"early tracer"}


def test_a_bad_checkpoint_is_reported_by_convert_not_the_tracer(tiny_qwen3_pair, tmp_path, monkeypatch) -> None:
    from dflash_cli.errors import CheckpointError

    pair = tiny_qwen3_pair.copy_to(tmp_path / "pair")
    config = json.loads((pair.draft_dir / "config.json").read_text())
    del config["dflash_config"]  # not a DFlash draft any more
    (pair.draft_dir / "config.json").write_text(json.dumps(config))
    calls = []
    real = early_trace.EarlyTrace.start
    monkeypatch.setattr(early_trace.EarlyTrace, "start", staticmethod(lambda r: calls.append(r) or real(r)))
    with pytest.raises(CheckpointError, match="dflash_config"):
        _build(pair, tmp_path / "build")
    assert len(calls) == 1  # tried, failed quietly; convert raised the error users see
