"""A large pair's twin is checked while the export still streams weights, and its verdict still counts."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest

from tests.engines import build_recipe
from tests.fixtures.tiny_pairs import TinyPair


@pytest.fixture
def twin_mode(monkeypatch):
    from dflash_cli.exporting import validate
    from dflash_cli.stages import export

    monkeypatch.setattr(export, "FULL_VALIDATION_BYTES", 0)  # validate a twin, as for a large pair
    monkeypatch.setattr(validate, "TWIN_VOCAB", 300)
    return validate


def test_each_twin_graph_is_checked_as_soon_as_it_is_written(
    tiny_qwen3_pair: TinyPair, tmp_path: Path, twin_mode, monkeypatch
):
    from dflash_cli.exporting import graphs
    from dflash_cli.pipeline import artifact_paths

    real_checks, real_finish, real_start = twin_mode.graph_checks, graphs.finish_template, twin_mode.TwinExport._start
    events, threads = [], {}

    def checks(gname, *args, **kwargs):
        threads[gname] = threading.current_thread().name
        return real_checks(gname, *args, **kwargs)

    def start(self, gname):
        events.append(("checks", gname))
        return real_start(self, gname)

    def finish(model, by_graph_name, path, *args, **kwargs):
        done = real_finish(model, by_graph_name, path, *args, **kwargs)
        events.append(("written", path.name))
        return done

    monkeypatch.setattr(twin_mode, "graph_checks", checks)
    monkeypatch.setattr(twin_mode.TwinExport, "_start", start)
    monkeypatch.setattr(graphs, "finish_template", finish)
    recipe, cache = build_recipe(tiny_qwen3_pair, tmp_path)
    started = {e[1]: i for i, e in enumerate(events) if e[0] == "checks"}
    written = {e[1]: i for i, e in enumerate(events) if e[0] == "written"}
    assert threads == {"target": "dflash-validation", "draft": "dflash-validation"}
    # the target's checks began before its real weights were written, the draft's before the last graph
    assert started["target"] < written["target.onnx"] and started["draft"] < written["draft_prefix.onnx"]
    doc = json.loads((artifact_paths(recipe, cache, ["export"])["export"] / "validation.json").read_text())
    assert {c["graph"] for c in doc["checks"]} == {"target", "draft"} and all(c["ok"] for c in doc["checks"])


def test_a_check_that_breaks_in_the_background_fails_the_build(
    tiny_qwen3_pair: TinyPair, tmp_path: Path, twin_mode, monkeypatch
):
    from dflash_cli.cache import Cache
    from dflash_cli.errors import CacheError
    from dflash_cli.pipeline import artifact_paths
    from dflash_cli.recipe import load_recipe

    real_checks = twin_mode.graph_checks

    def checks(gname, *args, **kwargs):
        if gname == "draft":
            raise RuntimeError("draft checks broke")
        return real_checks(gname, *args, **kwargs)

    monkeypatch.setattr(twin_mode, "graph_checks", checks)
    with pytest.raises(RuntimeError, match="draft checks broke"):
        build_recipe(tiny_qwen3_pair, tmp_path)
    recipe = load_recipe(str(tmp_path / "recipe.yaml"))
    with pytest.raises(CacheError, match="not built"):  # nothing half-made was published
        artifact_paths(recipe, Cache(tmp_path / "cache"), ["export"])


def test_twin_graphs_are_checked_one_at_a_time(tiny_qwen3_pair: TinyPair, tmp_path: Path, twin_mode, monkeypatch):
    """Each graph's checks hold a twin's modules and a session: two at once doubled that memory."""
    import time

    real_checks, real_start = twin_mode.graph_checks, twin_mode.TwinExport._start
    draft_made = threading.Event()
    running, most = [0], [0]
    guard = threading.Lock()

    def start(self, gname):
        real_start(self, gname)
        if gname == "draft":
            draft_made.set()

    def checks(gname, *args, **kwargs):
        with guard:
            running[0] += 1
            most[0] = max(most[0], running[0])
        try:
            if gname == "target":  # still running when the draft's checks could start
                draft_made.wait(60)
                time.sleep(0.5)  # time for them to start, were they allowed to
            return real_checks(gname, *args, **kwargs)
        finally:
            with guard:
                running[0] -= 1

    monkeypatch.setattr(twin_mode, "graph_checks", checks)
    monkeypatch.setattr(twin_mode.TwinExport, "_start", start)
    build_recipe(tiny_qwen3_pair, tmp_path)
    assert draft_made.is_set() and most[0] == 1
