"""The processor's compute peak, from its instruction set, cores and clock: what a verify row's achieved rate
is set beside in `dflash bench`'s decomposition.

A verify row is compute, not bandwidth: its weights are already being read for the other rows, so what it
costs is the multiply-adds. Counted per core and cycle, a multiply-add as two operations:

* AMX (Sapphire Rapids on): `tdpbusd` on a 16x64 by 64x16 tile pair, 1024 u8 x s8 multiply-adds a cycle
  (ONNX Runtime's `MatMulInteger` reaches it; `MatMulNBits` computes with VNNI);
* AVX-512 VNNI: `vpdpbusd` on 64 u8 x s8 pairs, two a cycle; AVX-VNNI the same on 32;
* AVX2 and AVX-512 without VNNI: `vpmaddubsw` then `vpmaddwd` per 32 (64) pairs, on two multiply pipes;
* fp32: two FMA pipes of 8 (16) lanes.

The clock is the highest the system reports (`cpuinfo_max_freq`, else /proc/cpuinfo's current one, which a
boosting processor runs above): a peak, not a promise. Other processors (Arm, unknown flags): None.
"""

from __future__ import annotations

import os
from pathlib import Path

# flag -> (int8 ops, fp32 flops) per core and cycle; the first flag the processor has wins
OPS_PER_CYCLE = (
    ("amx_int8", 2048, 64),
    ("avx512_vnni", 256, 64),
    ("avx_vnni", 128, 32),
    ("avx512bw", 128, 64),
    ("avx2", 64, 32),
)


def machine_peak(cpuinfo: str | None = None, max_khz: int | None = None, cores: int | None = None) -> dict | None:
    """{"isa", "cores", "ghz", "int8_gops", "fp32_gflops"}, or None where the instruction set is not known."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return None
    flags = next((line.split(":", 1)[1].split() for line in cpuinfo.splitlines() if line.startswith("flags")), [])
    found = next((row for row in OPS_PER_CYCLE if row[0] in flags), None)
    mhz = [float(line.split(":", 1)[1]) for line in cpuinfo.splitlines() if line.startswith("cpu MHz")]
    ghz = (max_khz if max_khz is not None else _max_khz()) / 1e6 or (max(mhz) / 1e3 if mhz else 0.0)
    if found is None or not ghz:
        return None
    cores = cores or len(os.sched_getaffinity(0))
    isa, int8_ops, fp32_flops = found
    return {
        "isa": isa,
        "cores": cores,
        "ghz": round(ghz, 2),
        "int8_gops": round(cores * ghz * int8_ops, 1),
        "fp32_gflops": round(cores * ghz * fp32_flops, 1),
    }


def _max_khz() -> int:
    try:
        return int(Path("/sys/devices/system/cpu/cpu0/cpufreq/cpuinfo_max_freq").read_text())
    except (OSError, ValueError):
        return 0
