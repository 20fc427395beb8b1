"""Versions of the tools whose output ends up in artifacts, and facts about the host for `doctor`.

Everything here reads package metadata (importlib.metadata) instead of importing the packages, so
cache keys and `dflash doctor` stay fast and never pull in torch.
"""

from __future__ import annotations

import functools
import platform
import shutil
import xml.etree.ElementTree as ET
from importlib import metadata
from pathlib import Path

import dflash_cli

# Distribution names to try per tool: CUDA/QNN hosts install onnxruntime under another name.
_DISTRIBUTIONS: dict[str, tuple[str, ...]] = {
    "torch": ("torch",),
    "transformers": ("transformers",),
    "onnx": ("onnx",),
    "onnxscript": ("onnxscript",),
    "onnx_ir": ("onnx-ir", "onnx_ir"),
    "safetensors": ("safetensors",),
    "onnxruntime": ("onnxruntime", "onnxruntime-gpu", "onnxruntime-qnn", "onnxruntime-openvino"),
}

QAIC_ROOT = Path("/opt/qti-aic")


def package_version(tool: str) -> str | None:
    """Installed version of `tool` (a key of the known tools or a distribution name), None if absent."""
    for dist in _DISTRIBUTIONS.get(tool, (tool,)):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return None


# Recorded in every manifest; a stage's key hashes only the ones its `tools` names.
RECORDED_TOOLS = ("torch", "transformers", "onnx", "onnxruntime")


@functools.cache
def tool_versions() -> dict[str, str]:
    """dflash's version and those of the recorded tools (every manifest keeps them)."""
    versions = {"dflash": dflash_cli.__version__}
    for tool in RECORDED_TOOLS:
        versions[tool] = package_version(tool) or "absent"
    return versions


def key_versions(tools: tuple[str, ...] | None) -> dict[str, str]:
    """What a stage's cache key hashes: only the tools that can change its output (all recorded ones when
    the stage does not say). dflash's own changes are the stage's `version` constant's job, so upgrading
    dflash or onnxruntime does not redo the convert of an 8B model."""
    if tools is None:
        return tool_versions()
    return {tool: package_version(tool) or "absent" for tool in tools}


def qaic_sdk_info(root: Path = QAIC_ROOT) -> dict[str, str | bool | None]:
    """Whether the Qualcomm Cloud AI SDK is installed, and where its compiler and runner live."""

    def tool(name: str) -> str | None:
        for candidate in (root / "exec" / name, root / "tools" / name):
            if candidate.is_file():
                return str(candidate)
        return shutil.which(name)

    return {
        "present": root.is_dir(),
        "root": str(root),
        "version": _qaic_sdk_version(root),
        "qaic_compile": tool("qaic-compile"),
        "qaic_exec": tool("qaic-exec"),
        "qaic_util": tool("qaic-util"),
    }


def _qaic_sdk_version(root: Path) -> str | None:
    # apps.xml carries <base_version> and <build_id>; parse only those two tags, tolerating any layout.
    path = root / "versions" / "apps.xml"
    try:
        tree = ET.parse(path)
    except (OSError, ET.ParseError):  # absent or malformed: the version is simply unknown
        return None
    base = tree.findtext(".//base_version")
    build = tree.findtext(".//build_id")
    if not base:
        return None
    return f"{base.strip()}.{build.strip()}" if build else base.strip()


def python_version() -> str:
    return platform.python_version()


def ort_providers() -> list[str]:
    """ONNX Runtime execution providers available here (imports onnxruntime, so only for `doctor`)."""
    try:
        import onnxruntime
    except ImportError:
        return []
    return list(onnxruntime.get_available_providers())
