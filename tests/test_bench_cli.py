"""`dflash bench` end to end with the engine builder replaced by the scripted fake."""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path
from types import SimpleNamespace

import pytest
import typer
from typer.testing import CliRunner

from dflash_cli.cli import bench as bench_cli
from tests.test_bench_fakes import FakeEngine


@pytest.fixture
def built(monkeypatch: pytest.MonkeyPatch) -> list[dict]:
    """Replace recipe loading and engine building; record each build's overrides."""
    builds: list[dict] = []
    engine_kw: dict = {}

    def load_recipe(ref: str, overrides: list[str]) -> SimpleNamespace:
        block = 4
        for item in overrides:
            key, _, value = item.partition("=")
            if key == "dflash.block_size":
                block = int(value)
        return SimpleNamespace(name=ref, block_size=block, overrides=list(overrides))

    def build_engine(recipe: SimpleNamespace, cache: object, progress: object) -> FakeEngine:
        builds.append({"overrides": recipe.overrides, "cache_root": cache.root})  # a dflash_cli.cache.store.Cache
        kw = dict(engine_kw)
        if recipe.block_size == 8:
            kw["dflash_accepts"] = (6,)
        return FakeEngine(block_size=recipe.block_size, **kw)

    fake_module = types.ModuleType("dflash_cli.decoding.engine")
    fake_module.build_engine = build_engine  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "dflash_cli.decoding.engine", fake_module)
    monkeypatch.setattr("dflash_cli.recipe.schema.load_recipe", load_recipe)
    builds.append({"engine_kw": engine_kw})  # index 0: knobs for the test
    return builds


@pytest.fixture
def dataset(tmp_path: Path) -> Path:
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"turns": [f"question {i}"]}) + "\n" for i in range(3)))
    return path


def _invoke(*args: str) -> object:
    app = typer.Typer()
    bench_cli.register(app)
    app.command("noop")(lambda: None)  # a second command keeps `bench` a named subcommand
    return CliRunner().invoke(app, ["bench", *args])


def _base(tmp_path: Path, dataset: Path) -> list[str]:
    return ["--dataset", str(dataset), "--cache-dir", str(tmp_path / "cache"), "--max-new-tokens", "9"]


def test_json_is_one_document_on_stdout(tmp_path: Path, dataset: Path, built: list[dict]) -> None:
    result = _invoke(*_base(tmp_path, dataset), "--json", "--output", str(tmp_path / "out" / "doc.json"))
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc["dataset"]["n_samples"] == 3 and doc["schema_version"] == 2
    assert json.loads((tmp_path / "out" / "doc.json").read_text()) == doc
    log = tmp_path / "cache" / "bench" / "demo-prompts-b4.jsonl"
    assert built[1]["cache_root"] == tmp_path / "cache"
    assert len(log.read_text().splitlines()) == 4


def test_tables_for_a_person(tmp_path: Path, dataset: Path, built: list[dict]) -> None:
    result = _invoke(*_base(tmp_path, dataset), "--results", str(tmp_path / "r.jsonl"))
    assert result.exit_code == 0, result.output
    assert "decode tok/s" in result.stdout and "lossless" in result.stdout
    assert (tmp_path / "r.jsonl").is_file()


def test_resume_generates_nothing_twice(tmp_path: Path, dataset: Path, built: list[dict]) -> None:
    args = [*_base(tmp_path, dataset), "--json", "--results", str(tmp_path / "r.jsonl")]
    assert _invoke(*args).exit_code == 0
    again = _invoke(*args, "--resume")
    assert again.exit_code == 0, again.output
    assert json.loads(again.stdout)["dataset"]["n_samples"] == 3


def test_lossless_mismatch_exits_3(tmp_path: Path, dataset: Path, built: list[dict]) -> None:
    built[0]["engine_kw"]["mismatch"] = {"dflash": 4}
    result = _invoke(*_base(tmp_path, dataset), "--json")
    assert result.exit_code == 3
    assert json.loads(result.stdout)["lossless"]["mismatches"]  # the report still came out
    assert "error: dflash output differs" in result.stderr and "at generated token 4" in result.stderr


def test_floor_exits_4(tmp_path: Path, dataset: Path, built: list[dict]) -> None:
    result = _invoke(*_base(tmp_path, dataset), "--json", "--min-tau", "3.5")
    assert result.exit_code == 4
    assert "mean acceptance length" in result.stderr


def test_bad_dataset_exits_1_before_building(tmp_path: Path, built: list[dict], monkeypatch) -> None:
    monkeypatch.setenv("DFLASH_DATASETS_DIR", str(tmp_path))
    result = _invoke("--dataset", "gsm8k")
    assert result.exit_code == 1
    assert "is not available offline: looked for" in result.stderr and "hint:" in result.stderr
    assert len(built) == 1  # no engine was built


def test_bad_options(tmp_path: Path, dataset: Path, built: list[dict]) -> None:
    assert _invoke(*_base(tmp_path, dataset), "--modes", "plain,eagle").exit_code == 1
    assert _invoke(*_base(tmp_path, dataset), "--block-sizes", "4,x").exit_code == 1
    result = _invoke(*_base(tmp_path, dataset), "--modes", "dflash", "--min-speedup", "2")
    assert result.exit_code == 1 and "needs the plain and dflash modes" in result.stderr


def test_block_size_sweep(tmp_path: Path, dataset: Path, built: list[dict]) -> None:
    results = tmp_path / "sweep.jsonl"
    result = _invoke(*_base(tmp_path, dataset), "--json", "--block-sizes", "4,8", "--results", str(results))
    assert result.exit_code == 0, result.output
    assert [b["overrides"] for b in built[1:]] == [["dflash.block_size=4"], ["dflash.block_size=8"]]
    doc = json.loads(result.stdout)
    assert doc["sweep"]["fastest_block_size"] == 8
    assert (tmp_path / "sweep-b4.jsonl").is_file() and (tmp_path / "sweep-b8.jsonl").is_file()


def test_help_documents_exit_codes_and_sampling() -> None:
    result = _invoke("--help")
    assert result.exit_code == 0
    text = " ".join(result.stdout.split())
    assert "3 lossless mismatch" in text and "4 a --min-speedup" in text
    assert "random.Random(SEED).sample" in text
