"""Find the Cloud AI 100 SDK, its version and the cards on this host.

The SDK is not on PyPI; it is installed under /opt/qti-aic. Tests (and unusual installs)
point DFLASH_QAIC_ROOT at another root with the same layout:

  exec/qaic-compile     compiler on SDK 1.21+ (preferred)
  exec/qaic-exec        older compiler; compiles only with -compile-only
  tools/qaic-util       `qaic-util -q` lists devices
  versions/apps.xml     Apps SDK version (<base_version>, <build_id>)
  versions/platform.xml Platform SDK version (same tags)
  dev/lib/<arch>        the `qaicrt` Python runtime
  dev/python            QAicApi_pb2 (IO descriptor protobuf)
"""

from __future__ import annotations

import logging
import os
import re
import subprocess
import xml.etree.ElementTree as ET
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

from dflash_cli.errors import BackendError

log = logging.getLogger(__name__)

DEFAULT_ROOT = Path("/opt/qti-aic")
ROOT_ENV = "DFLASH_QAIC_ROOT"
UTIL_TIMEOUT_S = 60

CompilerKind = Literal["qaic-compile", "qaic-exec"]
HwVersion = Literal["ai100", "ai200"]


# NSP cores of one card by hardware version, for when no card is visible to ask (qaic-util's "Nsp Total").
CORES_PER_CARD: dict[str, int] = {"ai100": 16}


def sdk_root() -> Path:
    """The SDK root: $DFLASH_QAIC_ROOT when set (tests, odd installs), else /opt/qti-aic."""
    return Path(os.environ.get(ROOT_ENV) or DEFAULT_ROOT)


@dataclass(frozen=True)
class QaicDevice:
    """One card (QID) as `qaic-util -q` reports it."""

    qid: int
    status: str | None = None  # "Ready" when usable
    nsp_total: int | None = None
    nsp_free: int | None = None
    dram_free: str | None = None  # as printed, e.g. "32692 MB"
    fw_image_variant: str | None = None  # e.g. "AIC100.REL"

    @property
    def ready(self) -> bool:
        return self.status == "Ready"


@dataclass(frozen=True)
class QaicSdk:
    """What was found under one SDK root; `compiler` is None when no compiler exists."""

    root: Path
    compiler: Path | None
    compiler_kind: CompilerKind | None
    util: Path | None
    apps_version: str | None
    platform_version: str | None

    @property
    def version(self) -> str | None:
        """The version that decides compiler output: the Apps SDK (it ships the compiler)."""
        return self.apps_version

    @property
    def compile_only(self) -> bool:
        """qaic-exec both compiles and runs; it needs -compile-only to stop after compiling."""
        return self.compiler_kind == "qaic-exec"


def find_sdk(root: Path | None = None) -> QaicSdk:
    """Inspect `root` (default: sdk_root()); never raises, absent parts are None."""
    root = root or sdk_root()
    compiler: Path | None = None
    kind: CompilerKind | None = None
    # Prefer qaic-compile: qaic-exec is the legacy tool kept for old SDKs.
    for name in ("qaic-compile", "qaic-exec"):
        candidate = root / "exec" / name
        if _is_executable(candidate):
            compiler, kind = candidate, name  # type: ignore[assignment]
            break
    util = root / "tools" / "qaic-util"
    return QaicSdk(
        root=root,
        compiler=compiler,
        compiler_kind=kind,
        util=util if _is_executable(util) else None,
        apps_version=read_version_file(root / "versions" / "apps.xml"),
        platform_version=read_version_file(root / "versions" / "platform.xml"),
    )


def require_sdk(root: Path | None = None) -> QaicSdk:
    """The SDK with a compiler, or a BackendError naming the missing path and the way out."""
    sdk = find_sdk(root)
    if sdk.compiler is None:
        missing = sdk.root / "exec" / "qaic-compile"
        raise BackendError(
            f"QAIC SDK not found at {missing}",
            hint=(
                "install the Cloud AI 100 SDK, or run `dflash compile --backend qaic --emit-script DIR` "
                "to get a bundle to compile on a QAIC host"
            ),
        )
    return sdk


def _is_executable(path: Path) -> bool:
    return path.is_file() and os.access(path, os.X_OK)


def parse_version_xml(text: str) -> str | None:
    """`<base_version>1.20</base_version>` + `<build_id>154</build_id>` -> "1.20.154".

    The tags may sit at any depth, so search the whole tree. A missing build id gives the
    base version alone; unparsable XML gives None (a version we cannot read is "unknown").
    """
    try:
        tree = ET.fromstring(text)
    except ET.ParseError:
        return None
    base = tree.find(".//base_version")
    if base is None or not (base.text or "").strip():
        return None
    version = base.text.strip()
    build = tree.find(".//build_id")
    if build is not None and (build.text or "").strip():
        version = f"{version}.{build.text.strip()}"
    return version


def read_version_file(path: Path) -> str | None:
    try:
        return parse_version_xml(path.read_text(encoding="utf-8", errors="replace"))
    except OSError:
        return None


_QID_RE = re.compile(r"^\s*QID\s+(\d+)\s*$")
_FIELD_RE = re.compile(r"^\s*([A-Za-z][A-Za-z0-9 _()/-]*?)\s*:\s*(.*?)\s*$")


def parse_qaic_util(text: str) -> list[QaicDevice]:
    """Parse `qaic-util -q`: a `QID n` line opens a device, `Key:Value` lines describe it."""
    devices: list[QaicDevice] = []
    current: dict[str, str] | None = None
    qid = -1

    def close() -> None:
        if current is not None:
            devices.append(_device_from_fields(qid, current))

    for line in text.splitlines():
        m = _QID_RE.match(line)
        if m:
            close()
            qid, current = int(m.group(1)), {}
            continue
        if current is None:
            continue  # header lines (LRT version, "Number of devices") come before any QID
        f = _FIELD_RE.match(line)
        if f:
            current.setdefault(f.group(1), f.group(2))
    close()
    return devices


def _device_from_fields(qid: int, fields: dict[str, str]) -> QaicDevice:
    return QaicDevice(
        qid=qid,
        status=fields.get("Status"),
        nsp_total=_int_or_none(fields.get("Nsp Total")),
        nsp_free=_int_or_none(fields.get("Nsp Free")),
        dram_free=fields.get("Dram Free"),
        fw_image_variant=fields.get("FW IMAGE_VARIANT"),
    )


def _int_or_none(value: str | None) -> int | None:
    try:
        return int(value) if value is not None else None
    except ValueError:
        return None


def hw_version_of(devices: list[QaicDevice]) -> HwVersion | None:
    """ai200 when any card's firmware variant names AIC200, ai100 for other cards, None for none."""
    if not devices:
        return None
    if any("AIC200" in (d.fw_image_variant or "").upper() for d in devices):
        return "ai200"
    return "ai100"


def query_devices(sdk: QaicSdk | None = None) -> list[QaicDevice]:
    """Run `qaic-util -q`; no tool, a failure or a timeout all mean "no devices" (logged)."""
    sdk = sdk or find_sdk()
    if sdk.util is None:
        return []
    try:
        proc = subprocess.run(
            [str(sdk.util), "-q"], capture_output=True, text=True, timeout=UTIL_TIMEOUT_S, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        log.warning("qaic-util -q failed: %s", exc)
        return []
    if proc.returncode != 0:
        log.warning("qaic-util -q exited %s: %s", proc.returncode, proc.stderr.strip()[-500:])
    return parse_qaic_util(proc.stdout)


def detect_hw_version(sdk: QaicSdk | None = None) -> HwVersion | None:
    """The card generation on this host, or None when no card answers."""
    return hw_version_of(query_devices(sdk))


def sdk_summary(root: Path | None = None) -> dict[str, Any]:
    """Everything `dflash doctor` shows about QAIC, as JSON-able values."""
    sdk = find_sdk(root)
    devices = query_devices(sdk) if sdk.util else []
    return {
        "present": sdk.compiler is not None,
        "root": str(sdk.root),
        "compiler": str(sdk.compiler) if sdk.compiler else None,
        "compiler_kind": sdk.compiler_kind,
        "qaic_util": str(sdk.util) if sdk.util else None,
        "apps_version": sdk.apps_version,
        "platform_version": sdk.platform_version,
        "hw_version": hw_version_of(devices),
        "devices": [asdict(d) | {"ready": d.ready} for d in devices],
    }
