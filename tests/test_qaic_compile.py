"""compile_graphs against tests/bin/fake-qaic-compile, a recording FAKE compiler (no SDK here)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import onnx
import pytest

from dflash_cli.errors import BackendError
from dflash_cli.qaic.command import CompilerTool, QaicCompileOptions, compiler_command
from dflash_cli.qaic.compile import compile_graphs, key_fields
from dflash_cli.qaic.sdk import find_sdk
from tests.qaic_graphs import build_target, with_local_function, write_export_dir

FAKE_COMPILER = Path(__file__).parent / "bin" / "fake-qaic-compile"


def fake_sdk_root(root: Path, compiler_name: str = "qaic-compile", version: str = "1.20") -> Path:
    """An SDK-shaped directory whose compiler is the FAKE (it only records and writes a stub)."""
    (root / "exec").mkdir(parents=True)
    shutil.copy2(FAKE_COMPILER, root / "exec" / compiler_name)
    (root / "versions").mkdir()
    (root / "versions" / "apps.xml").write_text(
        f"<versions><base_version>{version}</base_version><build_id>7</build_id></versions>"
    )
    return root


@pytest.fixture
def fake_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, Path]:
    root = fake_sdk_root(tmp_path / "sdk")
    record = tmp_path / "argv.jsonl"
    monkeypatch.setenv("DFLASH_QAIC_ROOT", str(root))
    monkeypatch.setenv("FAKE_QAIC_RECORD", str(record))
    for knob in ("FAKE_QAIC_FAIL", "FAKE_QAIC_NO_PROGRAM"):
        monkeypatch.delenv(knob, raising=False)
    return {"root": root, "record": record, "export": write_export_dir(tmp_path / "export"), "out": tmp_path / "out"}


def _recorded(record: Path) -> list[list[str]]:
    return [json.loads(line) for line in record.read_text().splitlines()]


def test_compile_runs_the_built_command_and_keeps_logs(fake_env: dict[str, Path]) -> None:
    messages: list[str] = []
    options = QaicCompileOptions(mxfp6_matmul=True)
    facts = compile_graphs(fake_env["export"], fake_env["out"], options, messages.append)

    recorded = _recorded(fake_env["record"])
    assert len(recorded) == 2
    tool = CompilerTool(str(fake_env["root"] / "exec" / "qaic-compile"))
    for argv, graph in zip(recorded, ("target", "draft")):
        expected = compiler_command(
            tool,
            fake_env["export"] / f"{graph}.onnx",
            fake_env["out"] / graph,
            options.for_graph(graph),  # 16 cores of one card: 8 for each program
            hw_version="ai100",
            has_local_functions=False,
        )
        assert argv[1:] == expected[1:]  # argv[0] is the program name the fake saw
        assert facts["graphs"][graph]["command"] == expected
        work = fake_env["out"] / graph
        assert (work / "qpc" / "programqpc.bin").is_file()
        assert (work / "specializations.json").is_file() and (work / "custom_io.yaml").is_file()
        log = (work / "compile.log").read_text()
        assert log.startswith("$ ") and "test double" in log and "fake compile done" in log
    assert facts["sdk"]["apps_version"] == "1.20.7" and facts["hw_version"] == "ai100"
    assert len(messages) == 2 and "target" in messages[0]


def test_two_devices_and_local_functions(fake_env: dict[str, Path], tmp_path: Path) -> None:
    export = write_export_dir(tmp_path / "fn_export", target=with_local_function(build_target()))
    compile_graphs(export, fake_env["out"], QaicCompileOptions(devices=[0, 1], aic_hw_version="ai200"))
    target_argv, draft_argv = _recorded(fake_env["record"])
    partition = fake_env["out"] / "target" / "mdp_partition.json"
    assert f"-mdp-load-partition-config={partition}" in target_argv
    assert partition.is_file()
    assert "-sub-functions" in target_argv and "-sub-functions" not in draft_argv
    assert "-aic-hw-version=ai200" in target_argv


def test_qaic_exec_gets_compile_only(
    fake_env: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = fake_sdk_root(tmp_path / "old_sdk", compiler_name="qaic-exec")
    monkeypatch.setenv("DFLASH_QAIC_ROOT", str(root))
    compile_graphs(fake_env["export"], fake_env["out"], QaicCompileOptions())
    for argv in _recorded(fake_env["record"]):
        assert argv[0] == "qaic-exec" and argv[-1] == "-compile-only"


def test_failure_quotes_unsupported_ops_and_log_tail(
    fake_env: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FAKE_QAIC_FAIL", "1")
    with pytest.raises(BackendError) as info:
        compile_graphs(fake_env["export"], fake_env["out"], QaicCompileOptions())
    message = info.value.message
    assert "failed on the target graph: exited with code 1" in message
    assert "Operator NonZero is unsupported" in message
    assert "Compilation failed" in message
    assert (fake_env["out"] / "target" / "compile.log").is_file()  # kept for the post-mortem


def test_exit_zero_without_program_is_a_failure(fake_env: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAKE_QAIC_NO_PROGRAM", "1")
    with pytest.raises(BackendError, match="wrote no qpc/programqpc.bin"):
        compile_graphs(fake_env["export"], fake_env["out"], QaicCompileOptions())


def test_missing_sdk(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DFLASH_QAIC_ROOT", str(tmp_path / "nowhere"))
    with pytest.raises(BackendError, match="QAIC SDK not found at .*exec/qaic-compile") as info:
        compile_graphs(write_export_dir(tmp_path / "e"), tmp_path / "o", QaicCompileOptions())
    assert "--emit-script" in (info.value.hint or "")


def test_key_fields_change_with_sdk_version(tmp_path: Path) -> None:
    options = QaicCompileOptions()
    old = key_fields(options, find_sdk(fake_sdk_root(tmp_path / "a", version="1.19")))
    new = key_fields(options, find_sdk(fake_sdk_root(tmp_path / "b", version="1.20")))
    assert old["sdk_version"] == "1.19.7" and new["sdk_version"] == "1.20.7"
    assert old != new
    assert old["hw_version"] == "ai100"  # no card, no recipe choice
    assert key_fields(QaicCompileOptions(aic_hw_version="ai200"), None)["hw_version"] == "ai200"


def test_readme_of_fake_is_explicit() -> None:
    # The fake must never be mistaken for the SDK.
    assert "FAKE qaic-compile" in FAKE_COMPILER.read_text()
    onnx.checker.check_model(build_target())  # the graphs it is fed are valid ONNX


def test_over_subscribed_card_is_refused_before_compiling(fake_env: dict[str, Path]) -> None:
    options = QaicCompileOptions.from_mapping({"target": {"num_cores": 16}, "draft": {"num_cores": 16}})
    with pytest.raises(BackendError) as info:
        compile_graphs(fake_env["export"], fake_env["out"], options)
    assert "ask for 32 (target 16 + draft 16)" in info.value.message
    assert not fake_env["record"].exists()  # the compiler never ran
