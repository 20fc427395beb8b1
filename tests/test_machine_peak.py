"""The processor peak `dflash bench` sets a verify row's rate beside (bench/machine_peak.py)."""

from __future__ import annotations

from dflash_cli.bench.machine_peak import machine_peak

AVX2 = "processor\t: 0\ncpu MHz\t\t: 2445.404\nflags\t\t: fpu sse2 avx avx2 fma\n"


def test_avx2_peak_from_flags_cores_and_clock() -> None:
    peak = machine_peak(AVX2, max_khz=0, cores=2)
    assert peak == {"isa": "avx2", "cores": 2, "ghz": 2.45, "int8_gops": 313.0, "fp32_gflops": 156.5}
    boosted = machine_peak(AVX2, max_khz=3_500_000, cores=2)
    assert boosted["ghz"] == 3.5 and boosted["int8_gops"] == 448.0


def test_vnni_wins_over_avx2_and_unknown_is_none() -> None:
    vnni = AVX2.replace("avx2", "avx2 avx512bw avx512_vnni")
    assert machine_peak(vnni, max_khz=2_000_000, cores=1)["int8_gops"] == 512.0
    amx = machine_peak(vnni.replace("avx2", "avx2 amx_int8"), max_khz=2_000_000, cores=2)
    assert amx["isa"] == "amx_int8" and amx["int8_gops"] == 8192.0 and amx["fp32_gflops"] == 256.0
    assert machine_peak("processor\t: 0\nFeatures\t: fp asimd\n", max_khz=2_000_000, cores=4) is None
    assert machine_peak("flags\t: avx2\n", max_khz=0, cores=2) is None  # no clock known
