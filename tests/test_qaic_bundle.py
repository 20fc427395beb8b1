"""emit_bundle: a compile bundle written without any SDK, its compile.sh checked and run
against tests/bin/fake-qaic-compile (a recording FAKE, not the Qualcomm compiler)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from dflash_cli.errors import BackendError
from dflash_cli.qaic.bundle import emit_bundle
from dflash_cli.qaic.command import QaicCompileOptions
from tests.qaic_golden import assert_golden
from tests.qaic_graphs import write_export_dir

FAKE_COMPILER = Path(__file__).parent / "bin" / "fake-qaic-compile"


@pytest.fixture
def no_sdk(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DFLASH_QAIC_ROOT", str(tmp_path / "no-sdk-here"))


def _run_script(bundle: Path, compiler: Path, record: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "QAIC_COMPILE": str(compiler), "FAKE_QAIC_RECORD": str(record)}
    env.pop("FAKE_QAIC_FAIL", None)
    return subprocess.run(["bash", str(bundle / "compile.sh")], env=env, capture_output=True, text=True, timeout=120)


def test_bundle_files_and_script(tmp_path: Path, no_sdk: None) -> None:
    export = write_export_dir(tmp_path / "export", external_data=True)
    bundle = emit_bundle(export, tmp_path / "bundle", QaicCompileOptions(mxint8_kv_cache=True))

    for name in (
        "export.json",
        "target.onnx",
        "target.onnx.data",
        "draft.onnx",
        "draft.onnx.data",
        "README.txt",
        "compile.sh",
        "target/specializations.json",
        "target/custom_io.yaml",
        "draft/specializations.json",
        "draft/custom_io.yaml",
    ):
        assert (bundle / name).is_file(), name
    assert not (bundle / "target" / "mdp_partition.json").exists()
    assert "mxint8" in (bundle / "draft" / "custom_io.yaml").read_text()
    script = (bundle / "compile.sh").read_text()
    assert_golden("bundle_compile.sh", script)
    assert "QAIC_COMPILE=${QAIC_COMPILE:-/opt/qti-aic/exec/qaic-compile}" in script
    assert "set -euo pipefail" in script
    assert str(tmp_path) not in script  # only paths relative to the bundle
    subprocess.run(["bash", "-n", str(bundle / "compile.sh")], check=True)
    assert "nothing in it has been compiled yet" in (bundle / "README.txt").read_text()


def test_script_runs_with_fake_compiler(tmp_path: Path, no_sdk: None) -> None:
    bundle = emit_bundle(write_export_dir(tmp_path / "export"), tmp_path / "b", QaicCompileOptions(devices=[0, 1]))
    record = tmp_path / "argv.jsonl"
    proc = _run_script(bundle, FAKE_COMPILER, record)
    assert proc.returncode == 0, proc.stderr
    argvs = [json.loads(line) for line in record.read_text().splitlines()]
    assert [a[1] for a in argvs] == ["-m=target.onnx", "-m=draft.onnx"]
    assert "-mdp-load-partition-config=target/mdp_partition.json" in argvs[0]
    assert all("-compile-only" not in a for a in argvs)
    for graph in ("target", "draft"):
        assert (bundle / graph / "qpc" / "programqpc.bin").is_file()
        assert "fake compile done" in (bundle / graph / "compile.log").read_text()


def test_script_adds_compile_only_for_qaic_exec(tmp_path: Path, no_sdk: None) -> None:
    bundle = emit_bundle(write_export_dir(tmp_path / "export"), tmp_path / "b", QaicCompileOptions())
    exec_fake = tmp_path / "bin" / "qaic-exec"
    exec_fake.parent.mkdir()
    shutil.copy2(FAKE_COMPILER, exec_fake)
    record = tmp_path / "argv.jsonl"
    assert _run_script(bundle, exec_fake, record).returncode == 0
    assert all(json.loads(line)[-1] == "-compile-only" for line in record.read_text().splitlines())


def test_script_fails_when_compile_fails(tmp_path: Path, no_sdk: None, monkeypatch: pytest.MonkeyPatch) -> None:
    bundle = emit_bundle(write_export_dir(tmp_path / "export"), tmp_path / "b", QaicCompileOptions())
    monkeypatch.setenv("FAKE_QAIC_FAIL", "1")
    env = {**os.environ, "QAIC_COMPILE": str(FAKE_COMPILER)}
    proc = subprocess.run(["bash", str(bundle / "compile.sh")], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert not (bundle / "draft" / "compile.log").exists()  # stopped at the first failure


def test_non_empty_destination_is_refused(tmp_path: Path, no_sdk: None) -> None:
    dest = tmp_path / "b"
    dest.mkdir()
    (dest / "old.txt").write_text("x")
    with pytest.raises(BackendError, match="not empty"):
        emit_bundle(write_export_dir(tmp_path / "export"), dest, QaicCompileOptions())
