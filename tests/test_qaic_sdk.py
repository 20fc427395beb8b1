"""SDK detection, version files and `qaic-util -q` parsing (no SDK on this machine: fakes only)."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from dflash_cli.errors import BackendError
from dflash_cli.qaic import sdk as sdk_mod
from dflash_cli.qaic.sdk import (
    find_sdk,
    hw_version_of,
    parse_qaic_util,
    parse_version_xml,
    require_sdk,
    sdk_summary,
)

# SYNTHETIC sample: shaped like the apps.xml that `grep build_id apps.xml -B1` shows in public
# install notes (<base_version>1.6</base_version>, <build_id>80</build_id>); the surrounding
# elements are invented.
SAMPLE_APPS_XML = """<?xml version="1.0" encoding="UTF-8"?>
<versions>
  <ci_build>
    <name>qaic-apps</name>
    <base_version>1.20</base_version>
    <build_id>154</build_id>
  </ci_build>
</versions>
"""

# SYNTHETIC sample in the layout of `qaic-util -q` output quoted in public install notes
# (field names verbatim, values invented); QID 1 is made an AI 200 card and not ready.
SAMPLE_QAIC_UTIL = """LRT QC_IMAGE_VERSION: LRT.AIC.6.7.1.6.52
LRT IMAGE_VARIANT: LRT.AIC.REL
Number of devices: 2
QID 0
        Status:Ready
        PCI Address:0000:01:00.0
        PCI Info:Processing accelerators Qualcomm Device a100
        HW Version:0.2.0.0
        FW Version:1.5.6
        FW QC_IMAGE_VERSION:QSM.AIC.1.5.6
        FW OEM_IMAGE_VERSION:
        FW IMAGE_VARIANT:AIC100.REL
        NSP Version:1.5.2
        Dram Total:32692 MB
        Dram Free:32000 MB
        Nsp Total:16
        Nsp Free:14
QID 1
        Status:Error
        PCI Address:0000:02:00.0
        FW IMAGE_VARIANT:AIC200.REL
        Dram Free:65000 MB
        Nsp Total:16
        Nsp Free:16
"""


def _executable(path: Path, text: str = "#!/bin/sh\nexit 0\n") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return path


def test_version_xml_joins_base_version_and_build_id() -> None:
    assert parse_version_xml(SAMPLE_APPS_XML) == "1.20.154"
    assert parse_version_xml("<v><base_version>1.21</base_version></v>") == "1.21"
    assert parse_version_xml("<v>no version</v>") is None
    assert parse_version_xml("not xml <") is None


def test_qaic_util_parsing() -> None:
    devices = parse_qaic_util(SAMPLE_QAIC_UTIL)
    assert [d.qid for d in devices] == [0, 1]
    first, second = devices
    assert first.ready and not second.ready
    assert (first.nsp_total, first.nsp_free, first.dram_free) == (16, 14, "32000 MB")
    assert first.fw_image_variant == "AIC100.REL"
    assert hw_version_of(devices[:1]) == "ai100"
    assert hw_version_of(devices) == "ai200"  # any AIC200 firmware variant
    assert hw_version_of([]) is None
    assert parse_qaic_util("") == []


def test_find_sdk_prefers_qaic_compile(tmp_path: Path) -> None:
    _executable(tmp_path / "exec" / "qaic-exec")
    assert find_sdk(tmp_path).compiler_kind == "qaic-exec"
    assert find_sdk(tmp_path).compile_only
    _executable(tmp_path / "exec" / "qaic-compile")
    (tmp_path / "versions").mkdir()
    (tmp_path / "versions" / "apps.xml").write_text(SAMPLE_APPS_XML)
    sdk = find_sdk(tmp_path)
    assert sdk.compiler == tmp_path / "exec" / "qaic-compile"
    assert sdk.compiler_kind == "qaic-compile" and not sdk.compile_only
    assert sdk.version == "1.20.154" and sdk.platform_version is None


def test_root_env_override(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DFLASH_QAIC_ROOT", str(tmp_path))
    _executable(tmp_path / "exec" / "qaic-compile")
    assert require_sdk().root == tmp_path


def test_missing_sdk_error_names_path_and_emit_script(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DFLASH_QAIC_ROOT", str(tmp_path / "none"))
    with pytest.raises(BackendError) as info:
        require_sdk()
    err = info.value
    assert err.message == f"QAIC SDK not found at {tmp_path / 'none' / 'exec' / 'qaic-compile'}"
    assert "--emit-script" in err.hint and "dflash compile --backend qaic" in err.hint


def test_default_root_is_opt_qti_aic(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("DFLASH_QAIC_ROOT", raising=False)
    assert sdk_mod.sdk_root() == Path("/opt/qti-aic")


def test_summary_runs_qaic_util(tmp_path: Path) -> None:
    sample = tmp_path / "sample.txt"
    sample.write_text(SAMPLE_QAIC_UTIL)
    # A fake qaic-util that prints the synthetic sample for `-q`.
    _executable(tmp_path / "tools" / "qaic-util", f'#!/bin/sh\n[ "$1" = "-q" ] && cat "{sample}"\n')
    summary = sdk_summary(tmp_path)
    assert summary["present"] is False  # no compiler in this root
    assert summary["qaic_util"] == str(tmp_path / "tools" / "qaic-util")
    assert summary["hw_version"] == "ai200"
    assert [d["qid"] for d in summary["devices"]] == [0, 1]
    assert summary["devices"][0]["ready"] is True


def test_summary_without_sdk(tmp_path: Path) -> None:
    summary = sdk_summary(tmp_path)
    assert summary["present"] is False and summary["devices"] == [] and summary["apps_version"] is None
