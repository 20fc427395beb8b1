"""Turn a finished bench document into pass/fail: losslessness (exit 3), then floors (exit 4).

They run after the report is written, so a failing bench still leaves its numbers behind.
"""

from __future__ import annotations

from typing import Any

from dflash_cli.errors import LosslessError, ThresholdError


def check_lossless(doc: dict[str, Any]) -> None:
    """Raise LosslessError naming the first prompt and generated-token position that diverged."""
    mismatches = doc.get("lossless", {}).get("mismatches", [])
    if not mismatches:
        return
    first = mismatches[0]
    turn = f" turn {first['turn']}" if first.get("turn") else ""
    block = f" (block size {first['block_size']})" if "block_size" in first else ""
    raise LosslessError(
        f"{first['mode']} output differs from plain greedy decoding on sample {first['sample_id']!r}{turn} "
        f"at generated {first.get('unit', 'token')} {first['position']}{block}: plain {first['expected']}, "
        f"{first['mode']} {first['got']}; {len(mismatches)} mismatch(es) in total",
        hint=_lossless_hint(doc.get("environment", {}).get("compile", {})),
    )


def _lossless_hint(compile_facts: dict[str, Any]) -> str:
    """Name the likelier cause: a precision that mixes positions, unless the build proved it does not."""
    precision = compile_facts.get("precision", "fp32")
    checks = str(compile_facts.get("checks", ""))
    checked = checks.startswith("smoke") and checks.endswith("causal invariance")
    kept = "every sample stays in the results file; "
    if precision != "fp32" and not checked:
        return (
            kept + f"this {precision} build was not checked for causal invariance at build time; a precision "
            "whose numbers depend on the other tokens of a call changes verify outputs: rebuild with "
            "--set compile.ort.precision=fp32 to tell"
        )
    proof = f"the {precision} target passed the causal-invariance check at build time, so " if checked else ""
    return (
        kept + proof + "a rollback or cache-position bug in the decoding loop is the usual cause "
        "(try `dflash run` on that prompt with DFLASH_DEBUG=1)"
    )


def check_floors(doc: dict[str, Any], *, min_speedup: float | None = None, min_tau: float | None = None) -> None:
    """Raise ThresholdError listing every floor the measured DFlash speedup / tau fell below."""
    failures = []
    if min_speedup is not None:
        speedup = doc.get("decode_speedup")
        if speedup is None:
            failures.append(f"decode speedup not measured (needs modes plain and dflash), floor {min_speedup:.2f}x")
        elif speedup < min_speedup:
            failures.append(f"decode speedup {speedup:.2f}x < floor {min_speedup:.2f}x")
    if min_tau is not None:
        tau = doc.get("mean_acceptance_length")
        if tau is None:
            failures.append(f"acceptance length not measured (needs mode dflash), floor {min_tau:.2f}")
        elif tau < min_tau:
            failures.append(f"mean acceptance length {tau:.2f} < floor {min_tau:.2f}")
    if failures:
        raise ThresholdError(
            "benchmark floor not met: " + "; ".join(failures),
            hint="tau near 1.00 means the draft is not helping (check the target/draft pair); "
            "a low speedup at good tau points at verify cost: try --block-sizes 4,8,16",
        )
