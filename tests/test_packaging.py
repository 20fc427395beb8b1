"""A wheel installs like a package: its own name, the `dflash` command, the shipped recipes and demo pair."""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.slow


def _run(cmd: list[str], cwd: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"{cmd} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    return proc


def test_wheel_in_a_fresh_venv_builds_the_demo(tmp_path: Path) -> None:
    wheels = tmp_path / "wheels"
    _run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(wheels),
          str(REPO)], cwd=tmp_path)  # fmt: skip
    (wheel,) = wheels.glob("*.whl")
    assert wheel.name.startswith("dflash_toolchain-")  # not "dflash": that name is another PyPI project

    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)], cwd=tmp_path)
    site = Path(_run([str(venv / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                     cwd=tmp_path).stdout.strip())  # fmt: skip
    # Dependencies come from this environment (a plain path entry: its editable-install hooks stay off),
    # so the test installs only our wheel, offline, in seconds.
    (site / "_test_deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    _run([sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"), "install", "-q", "--no-deps",
          str(wheel)], cwd=tmp_path)  # fmt: skip

    env = {k: v for k, v in os.environ.items() if not k.startswith("DFLASH_")}
    env["DFLASH_HOME"] = str(tmp_path / "cache")
    dflash = str(venv / "bin" / "dflash")
    where = _run([str(venv / "bin" / "python"), "-c", "import dflash_cli; print(dflash_cli.__file__)"], tmp_path, env)
    assert where.stdout.strip().startswith(str(site))  # the installed copy, not the checkout
    listed = _run([dflash, "recipes", "list"], cwd=tmp_path, env=env).stdout
    assert all(name in listed for name in ("demo", "qwen3-4b", "qwen3-8b", "llama3.1-8b"))
    _run([dflash, "build", "--recipe", "demo"], cwd=tmp_path, env=env)
    out = _run([dflash, "run", "--recipe", "demo", "--prompt", "def add(a, b):", "--max-new-tokens", "8", "--json"],
               cwd=tmp_path, env=env).stdout  # fmt: skip
    assert '"new_tokens": 8' in out
