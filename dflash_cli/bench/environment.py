"""The environment fingerprint stored with every bench document, so numbers can be compared later.

Package versions come from metadata (dflash_cli.host.versions), never by importing torch.
"""

from __future__ import annotations

import os
import platform
from pathlib import Path
from typing import Any

import dflash_cli
from dflash_cli.host.versions import package_version

_CPUINFO = Path("/proc/cpuinfo")
# Keys naming the CPU model in /proc/cpuinfo: x86 uses "model name", some ARM kernels the others.
_CPU_KEYS = ("model name", "Hardware", "Processor", "cpu model")


def cpu_model(cpuinfo: Path = _CPUINFO) -> str:
    """The CPU model from /proc/cpuinfo, else platform.processor(), else the machine type."""
    try:
        for line in cpuinfo.read_text(errors="replace").splitlines():
            key, _, value = line.partition(":")
            if key.strip() in _CPU_KEYS and value.strip():
                return value.strip()
    except OSError:  # not Linux, or /proc not mounted: fall back to what platform knows
        pass
    return platform.processor() or platform.machine() or "unknown"


def environment(engine_info: dict[str, Any]) -> dict[str, Any]:
    """Versions, host and engine identity; `engine_info` comes from runner.describe_engine()."""
    return {
        "python": platform.python_version(),
        "dflash": dflash_cli.__version__,
        "torch": package_version("torch"),
        "onnxruntime": package_version("onnxruntime"),
        "transformers": package_version("transformers"),
        "platform": platform.platform(),
        "machine": platform.machine(),
        "cpu": cpu_model(),
        "cpu_count": os.cpu_count(),
        "provider": engine_info.get("provider"),
        "recipe": engine_info.get("recipe"),
        "artifact_keys": engine_info.get("artifact_keys", {}),
        "compile": engine_info.get("compile", {}),
        "plain_session": engine_info.get("plain_session"),  # what the baseline ran on (Engine.open_plain_session)
    }
