"""`dflash check` on a QAIC recipe where no SDK or card is: the fp16 emulation runs the export's own graphs on
ONNX Runtime, so the check needs no compile (it used to stop at the compile stage for want of the SDK)."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from dflash_cli.cli.app import create_app


def test_fp16_checks_of_a_qaic_recipe_run_without_the_sdk(tiny_qwen3_pair, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("DFLASH_QAIC_ROOT", str(tmp_path / "no-sdk-here"))
    recipe = tiny_qwen3_pair.write_recipe(tmp_path / "recipe.yaml", compile={"backend": "qaic"})
    args = ["check", "--recipe", str(recipe), "--cache-dir", str(tmp_path / "cache"), "--json", "--no-bands"]
    args += ["--fp16-prompts", "2", "--max-new-tokens", "8", "--set", "export.ctx_len=1024"]
    result = CliRunner().invoke(create_app(), args)
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc["ok"] and doc["fp16"]["prompts"] == 2 and not doc["fp16"]["nonfinite"]
    assert not list((tmp_path / "cache").glob("artifacts/compile/*"))  # nothing was compiled
