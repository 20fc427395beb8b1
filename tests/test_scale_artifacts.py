"""Artifacts share weight files instead of copying them, and the cache stays safe across the shared files."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from dflash_cli.cache.store import Cache
from dflash_cli.cache.upkeep import verify
from dflash_cli.recipe.schema import load_recipe
from dflash_cli.stages.pipeline import artifact_paths, build
from tests.fixtures.tiny_pairs import TinyPair

pytestmark = pytest.mark.slow  # builds or exports pairs: left out of `make test-fast`


@pytest.fixture(scope="module")
def built(tiny_llama_pair: TinyPair, tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("shared")
    recipe = load_recipe(str(tiny_llama_pair.write_recipe(root / "recipe.yaml")))
    cache = Cache(root / "cache")
    build(recipe, cache)
    return recipe, cache, artifact_paths(recipe, cache, ("convert", "inject", "export", "compile"))


def test_each_stage_links_what_it_does_not_change(built, tiny_llama_pair: TinyPair) -> None:
    _, _, paths = built
    same = os.path.samefile
    assert same(paths["convert"] / "target" / "model.safetensors", tiny_llama_pair.target_dir / "model.safetensors")
    assert same(paths["inject"] / "target" / "model.safetensors", paths["convert"] / "target" / "model.safetensors")
    assert same(paths["inject"] / "draft" / "model.safetensors", paths["convert"] / "draft" / "model.safetensors")
    for name in ("target.onnx.data", "draft.onnx.data"):
        if (paths["export"] / name).exists():
            assert same(paths["compile"] / name, paths["export"] / name)  # fp32 compile: the export's weights
    # The graphs themselves are rewritten (compile.ort.fuse): small files that point at those weights.
    for name in ("target.onnx", "draft.onnx"):
        assert not same(paths["compile"] / name, paths["export"] / name)
        assert (paths["compile"] / name).stat().st_size < 1 << 20
    # The draft graph keeps no copy of the target's embedding / lm_head: it points into target.onnx.data.
    import onnx

    draft = onnx.load(str(paths["export"] / "draft.onnx"), load_external_data=False)
    places = {t.name: {e.key: e.value for e in t.external_data} for t in draft.graph.initializer}
    assert places["inner.draft.embed_tokens.weight"]["location"] == "target.onnx.data"
    assert places["inner.draft.lm_head.weight"]["location"] == "target.onnx.data"


def test_manifests_reuse_digests_of_linked_files(built) -> None:
    _, cache, paths = built
    manifests = {s: json.loads((p / "manifest.json").read_text()) for s, p in paths.items()}
    digests = {(o["inode"], o["sha256"]) for m in manifests.values() for o in m["outputs"]}
    ino = os.stat(paths["export"] / "target.onnx.data").st_ino
    assert len({d for i, d in digests if i == ino}) == 1  # one digest per shared inode
    assert all(r.ok for r in verify(cache))


def test_cache_size_counts_shared_files_once(built) -> None:
    _, cache, paths = built
    seen, total = set(), 0
    for p in cache.root.rglob("*"):
        if p.is_file():
            st = p.stat()
            if st.st_ino not in seen:
                seen.add(st.st_ino)
                total += st.st_size
    assert cache.size() == total
    linked = sum(o["size"] for p in paths.values() for o in json.loads((p / "manifest.json").read_text())["outputs"])
    assert cache.size() < linked  # the per-artifact sizes add shared files up more than once


def test_removing_an_artifact_keeps_files_other_artifacts_use(tiny_qwen3_pair: TinyPair, tmp_path: Path) -> None:
    recipe = load_recipe(str(tiny_qwen3_pair.write_recipe(tmp_path / "recipe.yaml")))
    cache = Cache(tmp_path / "cache")
    build(recipe, cache)
    paths = artifact_paths(recipe, cache, ("convert", "inject", "export", "compile"))
    entries = {e.stage: e for e in cache.entries()}
    # What clean would free for convert alone: nothing that inject still links (nor the user's checkpoint).
    from dflash_cli.cache.upkeep import freed_bytes

    side = sum(p.stat().st_size for p in paths["convert"].rglob("*") if p.is_file() and p.suffix != ".safetensors")
    assert freed_bytes([paths["convert"]]) == side  # configs and tokenizer only: the weights are still linked
    assert freed_bytes([paths["export"]]) == sum(  # compile links every data file (its graphs are rewritten)
        p.stat().st_size for p in paths["export"].rglob("*") if p.suffix != ".data"
    )
    cache._trash(entries["convert"].path)
    cache._trash(entries["export"].path)
    assert all(r.ok for r in verify(cache))  # inject and compile are whole without them
    from dflash_cli.decoding.engine import Engine

    # The engine needs export too: rebuild it (from inject, which survived) and generate.
    build(recipe, cache)
    engine = Engine.load(recipe, cache)
    assert engine.generate([3, 4, 5], mode="dflash", max_new_tokens=5).tokens
    assert (tiny_qwen3_pair.target_dir / "model.safetensors").is_file()  # the checkpoint never goes


def test_flipped_byte_in_a_shared_file_shows_in_every_artifact_using_it(tiny_qwen3_pair, tmp_path) -> None:
    recipe = load_recipe(str(tiny_qwen3_pair.write_recipe(tmp_path / "recipe.yaml")))
    cache = Cache(tmp_path / "cache")
    build(recipe, cache)
    data = artifact_paths(recipe, cache, ["export"])["export"] / "target.onnx.data"
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    with data.open("r+b") as f:  # in place: the same inode, as a disk fault would
        f.write(raw)
    bad = {r.entry.stage for r in verify(cache) if not r.ok}
    assert bad == {"export", "compile"}


def test_killed_export_publishes_nothing_and_leaves_upstream_whole(tiny_qwen3_pair, tmp_path, monkeypatch) -> None:
    from dflash_cli.exporting import graphs

    recipe = load_recipe(str(tiny_qwen3_pair.write_recipe(tmp_path / "recipe.yaml")))
    cache = Cache(tmp_path / "cache")

    def killed(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(graphs, "trace_template", killed)
    with pytest.raises(KeyboardInterrupt):
        build(recipe, cache)
    assert {e.stage for e in cache.entries()} == {"convert", "inject"}
    assert all(r.ok for r in verify(cache))
    assert not list(cache.tmp_dir.glob("export-*"))
    assert (tiny_qwen3_pair.target_dir / "model.safetensors").is_file()


def test_plain_decoding_never_loads_the_draft(built) -> None:
    from dflash_cli.decoding.engine import Engine

    recipe, cache, _ = built
    engine = Engine.load(recipe, cache)
    plain = engine.generate([3, 4, 5, 6], mode="plain", max_new_tokens=6)
    assert engine._draft is None  # `dflash run --no-draft` holds only the target in memory
    assert engine.generate([3, 4, 5, 6], mode="dflash", max_new_tokens=6).tokens == plain.tokens
    assert engine._draft is not None


def test_both_sessions_share_one_memory_mapped_embedding(built) -> None:
    from dflash_cli.decoding.engine import Engine

    recipe, cache, _ = built
    engine = Engine.load(recipe, cache)
    plain = engine.generate([3, 4, 5, 6], mode="plain", max_new_tokens=6)
    assert engine._tables.count == 1  # the target's embedding table
    assert engine.generate([3, 4, 5, 6], mode="dflash", max_new_tokens=6).tokens == plain.tokens
    assert engine._tables.count == 1  # the draft's embedding is the same mapping, not a second copy
