"""An export whose reduced-model checks would not fit the machine's memory skips them with a line saying
why, instead of being killed by the kernel mid-build; the build goes on and the compile still checks."""

from __future__ import annotations

import pytest

from tests.fixtures.tiny_pairs import make_pair


@pytest.mark.slow
def test_validation_that_does_not_fit_is_skipped_with_the_reason(tmp_path, monkeypatch) -> None:
    from dflash_cli.cache.store import Cache
    from dflash_cli.host import memory as process_memory
    from dflash_cli.recipe.schema import load_recipe
    from dflash_cli.stages.pipeline import build

    monkeypatch.setattr(process_memory, "available_bytes", lambda: 1 << 20)  # 1 MiB free
    pair = make_pair(tmp_path / "pair", "qwen3")
    path = pair.write_recipe(tmp_path / "recipe.yaml", compile={"ort": {"precision": "int4", "block_size": 16}})
    lines: list[str] = []
    result = build(load_recipe(str(path)), Cache(tmp_path / "cache"), progress=lambda e: lines.append(str(e.message)))
    skipped = [line for line in lines if "validation skipped" in line]
    assert skipped and "GiB is available" in skipped[0]
    assert not (result.path("export") / "validation.json").exists()
    assert (result.path("compile") / "compile.json").is_file()
