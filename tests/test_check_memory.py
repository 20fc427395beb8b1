"""`dflash check` skips the fp16 emulation checks, with a line saying why, when they would not fit in memory."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from dflash_cli.cli.app import create_app
from dflash_cli.readiness import memory


def test_emulation_needs_both_graphs_twice(qwen3_engine) -> None:
    need = memory.emulation_bytes(qwen3_engine.export_dir)
    assert need >= 2 * sum(qwen3_engine.weight_bytes.values()) * 0.9  # fp32 export: reference + emulation


def test_check_skips_fp16_checks_that_do_not_fit(tiny_qwen3_pair, tmp_path, monkeypatch) -> None:
    recipe = tiny_qwen3_pair.write_recipe(tmp_path / "recipe.yaml")
    monkeypatch.setattr(memory, "available_bytes", lambda: 1 << 20)  # 1 MiB free
    args = ["check", "--recipe", str(recipe), "--cache-dir", str(tmp_path / "cache"), "--fp16-prompts", "2", "--json"]
    result = CliRunner().invoke(create_app(), args)
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert "GiB is available" in doc["fp16_skipped"]
    assert "fp16" not in doc and "fp16_bands" not in doc and doc["ok"]


def test_fits_when_memory_is_plenty(qwen3_engine, monkeypatch) -> None:
    monkeypatch.setattr(memory, "available_bytes", lambda: 1 << 40)
    assert memory.emulation_does_not_fit(qwen3_engine.export_dir) is None


def test_prompt_and_band_checks_share_one_engine(tiny_qwen3_pair, tmp_path, monkeypatch) -> None:
    """Both fp16 checks run on one fp32 engine: loading it for each held two at once."""
    from dflash_cli.decoding.engine import Engine

    loads, real = [], Engine.load
    monkeypatch.setattr(Engine, "load", classmethod(lambda cls, *a, **k: loads.append(1) or real(*a, **k)))
    recipe = tiny_qwen3_pair.write_recipe(tmp_path / "recipe.yaml")
    args = ["check", "--recipe", str(recipe), "--cache-dir", str(tmp_path / "cache"), "--json"]
    result = CliRunner().invoke(
        create_app(), [*args, "--fp16-prompts", "1", "--max-new-tokens", "4", "--set", "export.ctx_len=1024"]
    )
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    doc = json.loads(result.stdout)
    assert "fp16" in doc and "fp16_bands" in doc and loads == [1]
