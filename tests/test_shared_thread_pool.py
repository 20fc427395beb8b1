"""The process-wide ONNX Runtime thread pool (compile.ort.thread_pool: shared), in processes of its own."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.engines import build_recipe

_SCRIPT = """
import json, sys
from dflash_cli.host.ort_threads import shared_thread_pool
from dflash_cli.cache.store import Cache
from dflash_cli.decoding.engine import Engine
from dflash_cli.recipe.schema import load_recipe

engine = Engine.load(load_recipe(sys.argv[1], sys.argv[3:]), Cache(sys.argv[2]))
same = []
for prompt in ([5, 6, 7, 8], [9, 3, 3, 3, 3, 9, 3, 3], list(range(2, 30))):
    plain = engine.generate(prompt, mode="plain", max_new_tokens=16).tokens
    same += [engine.generate(prompt, mode=m, max_new_tokens=16).tokens == plain for m in ("dflash", "lookup", "hybrid")]
print(json.dumps({"shared": shared_thread_pool(), "same": same, "plain_on": engine.open_plain_session()}))
"""


def _run(recipe: Path, cache: Path, *sets: str) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", _SCRIPT, str(recipe), str(cache), *sets], capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_shared_pool_is_the_default_and_stays_lossless(tiny_qwen3_pair, tmp_path: Path) -> None:
    build_recipe(tiny_qwen3_pair, tmp_path)
    got = _run(tmp_path / "recipe.yaml", tmp_path / "cache")
    assert got["shared"] and all(got["same"]), got
    assert "shared" in got["plain_on"]  # bench's plain needs no spinning session of its own then


def test_per_session_pools_when_asked(tiny_qwen3_pair, tmp_path: Path) -> None:
    build_recipe(tiny_qwen3_pair, tmp_path)
    got = _run(tmp_path / "recipe.yaml", tmp_path / "cache", "compile.ort.thread_pool=per_session")
    assert not got["shared"] and all(got["same"]), got
