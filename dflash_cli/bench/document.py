"""The bench's JSON document (schema_version 2): the numbers CI reads, and the tables render.

Field names follow what the field already uses (`mean_acceptance_length`, `acceptance_histogram`,
`decode_speedup`). Times are seconds (`*_s`); rates are per second. A value that cannot be
measured in a run (e.g. a speedup without the plain baseline) is null rather than absent.

Each mode's summary is a top-level section named after the mode (decoding/modes.py), plain's being
"baseline". Schema 2 renamed prompt lookup from "pld" to "lookup" everywhere (its section, the keys of
`repetition_rate` and `decomposition.weight_bandwidth_gb_s`, `settings.modes`, mismatches' `mode`);
nothing else changed from schema 1. Alias: schema 2 still writes the lookup section under "pld" too (the
same object), for readers of schema 1; schema 3 drops it. `upgrade_document` reads a schema-1
document's "pld" as "lookup".
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from dflash_cli.bench import metrics
from dflash_cli.bench.datasets import dataset_name
from dflash_cli.bench.environment import environment
from dflash_cli.bench.machine_peak import machine_peak
from dflash_cli.bench.runner import BASELINE_MODE, BenchResult
from dflash_cli.bench.spread import bootstrap, spread
from dflash_cli.bench.vllm_fields import latency_fields, spec_decode_fields
from dflash_cli.decoding.modes import ALIASES, MODES, MODES_INFO, SPECULATIVE_MODES, mode_info
from dflash_cli.decoding.result import GenerationResult
from dflash_cli.errors import DFlashError

SCHEMA_VERSION = 2  # fields are only ever added within a version
PLD_ALIAS = "pld"  # schema 2 only: the lookup section's schema-1 key, see above


def section_key(mode: str) -> str:
    """The top-level key of a mode's summary: the mode's name, plain's being "baseline"."""
    return "baseline" if mode == BASELINE_MODE else mode


# (section, label) of every section that holds one mode's numbers, in report order; "endpoint" is what
# `dflash bench --endpoint` measured (a server, whatever it runs).
MODE_SECTIONS = (*((section_key(m.name), m.label) for m in MODES_INFO), ("endpoint", "endpoint"))


def build_document(result: BenchResult, *, env: dict[str, Any] | None = None) -> dict[str, Any]:
    """Every reported number of one bench run (one engine, one block size)."""
    block = result.block_size
    by_mode = {mode: result.results_for(mode) for mode in result.modes}
    baseline = by_mode.get(BASELINE_MODE)
    summaries = {
        mode: mode_summary(results, block, baseline, speculative=mode in SPECULATIVE_MODES)
        for mode, results in by_mode.items()
    }
    for mode, summary in summaries.items():
        if summary.get("decode_speedup") is not None:
            summary["decode_speedup_bootstrap"] = speedup_interval(result, mode)
            summary["decode_speedup_per_sample"] = speedup_per_sample(result, mode)
    dflash = summaries.get("dflash")
    repetition_source = BASELINE_MODE if BASELINE_MODE in summaries else result.modes[0]
    vllm_top = {}
    if dflash:  # vLLM's names at the top level describe DFlash, as the legacy top-level fields do
        vllm_top = {k: v for k, v in dflash.items() if k.startswith("spec_decode_")}
        vllm_top.update({k: dflash[k] for k in LATENCY_KEYS})
    return {
        "schema_version": SCHEMA_VERSION,
        "timestamp": _now(),  # when this document was made (UTC)
        "tool_commit": tool_commit(),
        "environment": env if env is not None else environment(result.engine_info),
        "settings": result.settings,
        "dataset": {
            "name": dataset_name(result.settings["dataset"]),
            "spec": result.settings["dataset"],
            "n_samples": len(result.sample_ids),
            "n_turns": len(result.records),
            "sample_ids": list(result.sample_ids),
        },
        "baseline": summaries.get(BASELINE_MODE),
        **{mode: summaries.get(mode) for mode in SPECULATIVE_MODES},
        PLD_ALIAS: summaries.get("lookup"),
        "decode_speedup": dflash["decode_speedup"] if dflash else None,
        "decode_speedup_median": dflash["decode_speedup_median"] if dflash else None,
        "mean_acceptance_length": dflash["mean_acceptance_length"] if dflash else None,
        "acceptance_histogram": dflash["acceptance_histogram"] if dflash else None,
        "per_position_acceptance": dflash["per_position_acceptance"] if dflash else None,
        "repetition_rate": {
            "median": summaries[repetition_source]["repetition_rate"],
            **{mode: s["repetition_rate"] for mode, s in summaries.items()},
        },
        "decode_speedup_bootstrap": dflash.get("decode_speedup_bootstrap") if dflash else None,
        **vllm_top,
        "decomposition": decomposition(result, by_mode) if "dflash" in by_mode else None,
        "lossless": {
            "checked": result.lossless_checked,
            "mismatches": [asdict(m) for m in result.mismatches],
        },
    }


def mode_summary(
    results: list[GenerationResult],
    block_size: int,
    baseline: list[GenerationResult] | None,
    *,
    speculative: bool,
) -> dict[str, Any]:
    """One mode's numbers; speculative modes add acceptance statistics and their speedup over plain."""
    ttft = metrics.ttft_stats(results)
    summary: dict[str, Any] = {
        "n_generations": len(results),
        "new_tokens": sum(r.new_tokens for r in results),
        "decode_tokens": metrics.total_decode_tokens(results),
        "decode_s": metrics.total_decode_s(results),
        "decode_tokens_per_s": metrics.decode_tokens_per_s(results),
        "tpot_s": metrics.time_per_output_token(results),
        "ttft_s": ttft["median"],
        "ttft_mean_s": ttft["mean"],
        "end_to_end_tokens_per_s": metrics.end_to_end_tokens_per_s(results),
        "steps": sum(metrics.decode_steps(r) for r in results),
        "steps_per_s": metrics.steps_per_s(results),
        "loop_overhead_fraction": metrics.loop_overhead_fraction(results),
        "repetition_rate": metrics.median_repetition_rate(results),
        "mean_acceptance_length": metrics.mean_acceptance_length(results),
        "mean_acceptance_length_per_sample": metrics.mean_acceptance_length_per_sample(results),
        # Spread over generations (each repetition counts): ms, and tokens/s.
        "ttft_ms_spread": spread([r.prefill_s * 1000 for r in results]),
        "tpot_ms_spread": spread([r.time_per_output_token * 1000 for r in results if r.decode_tokens]),
        "decode_tokens_per_s_spread": spread([r.decode_tokens_per_s for r in results if r.decode_tokens]),
        **latency_fields(results),
    }
    if speculative:
        paired = baseline is not None and len(baseline) == len(results)
        # The hybrid's lookup steps may verify past the block: its tables run to its longest verify.
        longest = max([block_size] + [length for r in results for length in r.verify_lengths])
        summary.update(
            acceptance_histogram=metrics.acceptance_histogram(results, longest),
            per_position_acceptance=metrics.per_position_acceptance(results, longest),
            decode_speedup=metrics.decode_speedup(baseline, results) if paired else None,
            decode_speedup_median=metrics.median_pairwise_speedup(baseline, results) if paired else None,
        )
        summary.update(spec_decode_fields(results, block_size))
        if any(r.step_sources for r in results):
            summary["sources"] = metrics.source_split(results)
    return summary


LATENCY_KEYS = (
    "mean_ttft_ms",
    "median_ttft_ms",
    "p99_ttft_ms",
    "mean_tpot_ms",
    "median_tpot_ms",
    "p99_tpot_ms",
    "output_throughput",
    "completed",
    "duration",
)


def speedup_interval(result: BenchResult, mode: str) -> dict[str, Any]:
    """Bootstrap over samples (all turns and repetitions of a sample stay together) of the pooled
    decode speedup of `mode` over plain: its 95% interval and standard deviation."""
    by_sample: dict[str, list[tuple[GenerationResult, GenerationResult]]] = {}
    for record in result.records:
        if BASELINE_MODE in record.results and mode in record.results:
            pair = (record.results[BASELINE_MODE], record.results[mode])
            by_sample.setdefault(record.sample_id, []).append(pair)

    def pooled(groups: list[list[tuple[GenerationResult, GenerationResult]]]) -> float:
        pairs = [p for g in groups for p in g]
        return metrics.decode_speedup([b for b, _ in pairs], [c for _, c in pairs])

    return bootstrap(list(by_sample.values()), pooled)


def speedup_per_sample(result: BenchResult, mode: str) -> dict[str, float]:
    """Each sample's own pooled decode speedup of `mode` over plain (the distribution `--plot` draws)."""
    by_sample: dict[str, list[tuple[GenerationResult, GenerationResult]]] = {}
    for record in result.records:
        if BASELINE_MODE in record.results and mode in record.results:
            by_sample.setdefault(record.sample_id, []).append((record.results[BASELINE_MODE], record.results[mode]))
    out = {}
    for sample, pairs in by_sample.items():
        value = metrics.decode_speedup([b for b, _ in pairs], [c for _, c in pairs])
        if value is not None:
            out[sample] = value
    return out


def tool_commit() -> str | None:
    """The git commit of this dflash checkout, when it runs from one (None for an installed wheel)."""
    import subprocess
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    if not (root / ".git").exists():
        return None
    try:
        out = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None


def _now() -> str:
    from datetime import UTC, datetime

    return datetime.now(UTC).isoformat(timespec="seconds")


def decomposition(result: BenchResult, by_mode: dict[str, list[GenerationResult]]) -> dict[str, Any]:
    """Measured DFlash speedup beside its ceiling from step times, bandwidth and loop overhead."""
    dflash = by_mode["dflash"]
    baseline = by_mode.get(BASELINE_MODE)
    weights = result.engine_info.get("weight_bytes", {})
    target_bytes, draft_bytes = int(weights.get("target", 0)), int(weights.get("draft", 0))
    times = result.step_times or {}
    t1, t_verify, t_draft = times.get("t1"), times.get("t_verify"), times.get("t_draft")
    tau = metrics.mean_acceptance_length(dflash)
    ceiling = metrics.ceiling_speedup(tau, t1, t_verify, t_draft) if None not in (t1, t_verify, t_draft) else None
    bandwidth: dict[str, float] = {"dflash": metrics.weight_bandwidth_gb_s(dflash, target_bytes + draft_bytes)}
    for mode in MODES:
        if mode != "dflash" and mode in by_mode:  # the hybrid's lookup steps skip the draft: this overstates it
            read = target_bytes + (draft_bytes if mode_info(mode).uses_draft else 0)
            bandwidth[mode] = metrics.weight_bandwidth_gb_s(by_mode[mode], read)
    curve = {int(n): s for n, s in (times.get("t_verify_curve") or {}).items()}
    drafts = {int(n): s for n, s in (times.get("t_draft_curve") or {}).items()}
    by_rows = {n: (d + curve[n]) / t1 for n, d in drafts.items() if n in curve} if t1 else {}
    asked = {int(n): s for n, s in (times.get("t_draft_proposals_curve") or {}).items()}
    row_s = (curve[max(curve)] - curve[1]) / (max(curve) - 1) if 1 in curve and max(curve) > 1 else None
    macs = result.engine_info.get("target_macs_per_row")
    by_verify = {n: (d + curve[n]) / t1 for n, d in asked.items() if n in curve} if t1 else {}
    return {
        "block_size": result.block_size,
        "t1_s": t1,
        "t_verify_s": t_verify,
        "t_draft_s": t_draft,
        # target-call seconds per number of tokens, and relative to one token (T(n) / T(1))
        "t_verify_curve_s": curve or None,
        "verify_cost_ratio": {n: s / t1 for n, s in curve.items()} if curve and t1 else None,
        # the tau at which a DFlash step of a whole block costs what plain decoding does
        "break_even_tau": (t_verify + t_draft) / t1 if None not in (t1, t_verify, t_draft) and t1 else None,
        # draft-call seconds per number of rows (a draft graph that takes any), and the break-even tau of a step
        # that drafts and verifies n rows: (T_draft(n) + T(n)) / T(1)
        "t_draft_curve_s": drafts or None,
        "break_even_tau_by_rows": by_rows or None,
        # a whole-block draft asking for n - 1 proposals (what run.verify auto does), and its step's break-even
        # tau when it verifies n: (T_draft(n - 1 proposals) + T(n)) / T(1)
        "t_draft_proposals_curve_s": asked or None,
        "break_even_tau_by_verify": by_verify or None,
        # what one more verify row costs ((T(B) - T(1)) / (B - 1)), its rate in the target's weight products
        # (two operations a multiply-add), and the processor's peak (bench/machine_peak.py)
        "verify_row_s": row_s,
        "target_macs_per_row": macs,
        "verify_row_gops": 2 * macs / row_s / 1e9 if macs and row_s and row_s > 0 else None,
        "machine_peak": machine_peak(),
        "mean_acceptance_length": tau,
        "ceiling_speedup": ceiling,
        "measured_speedup": metrics.decode_speedup(baseline, dflash) if baseline is not None else None,
        "weight_bandwidth_gb_s": bandwidth,
        "weight_bytes": {"target": target_bytes, "draft": draft_bytes},
        "loop_overhead_fraction": metrics.loop_overhead_fraction(dflash),
    }


def fastest_run(docs: dict[int, dict[str, Any]]) -> int:
    """Block size whose DFlash decodes fastest (absolute tokens/s: each run's baseline has its own noise)."""

    def speed(doc: dict[str, Any]) -> float:
        mode = doc.get("dflash") or doc.get("baseline") or {}
        return mode.get("decode_tokens_per_s", 0.0)

    return max(docs, key=lambda b: speed(docs[b]))


def build_sweep_document(docs: dict[int, dict[str, Any]]) -> dict[str, Any]:
    """The fastest block size's document, plus `sweep` rows for every size and all mismatches."""
    best = fastest_run(docs)
    doc = dict(docs[best])
    doc["lossless"] = {
        "checked": any(d["lossless"]["checked"] for d in docs.values()),
        "mismatches": [{"block_size": b, **m} for b, d in docs.items() for m in d["lossless"]["mismatches"]],
    }
    doc["sweep"] = {
        "fastest_block_size": best,
        "criterion": "dflash.decode_tokens_per_s",
        "runs": [_sweep_row(b, d) for b, d in sorted(docs.items())],
    }
    return doc


def _sweep_row(block_size: int, doc: dict[str, Any]) -> dict[str, Any]:
    dflash = doc.get("dflash") or {}
    decomposition_ = doc.get("decomposition") or {}
    return {
        "block_size": block_size,
        "decode_tokens_per_s": dflash.get("decode_tokens_per_s"),
        "tpot_s": dflash.get("tpot_s"),
        "baseline_decode_tokens_per_s": (doc.get("baseline") or {}).get("decode_tokens_per_s"),
        "decode_speedup": doc.get("decode_speedup"),
        "mean_acceptance_length": doc.get("mean_acceptance_length"),
        "ceiling_speedup": decomposition_.get("ceiling_speedup"),
        "t_verify_s": decomposition_.get("t_verify_s"),
        "lossless_mismatches": len(doc["lossless"]["mismatches"]),
    }


def check_document(doc: Any, name: str) -> None:
    """Refuse what is not a bench result document (`name`: the file, for the message).

    Every schema so far has `settings`, `dataset` and at least one mode section (MODE_SECTIONS, or a
    schema-1 alias); a schema newer than this tool's may have changed any of them.
    """
    hint = "pass documents written by `dflash bench --output`"
    problem = None
    version = doc.get("schema_version") if isinstance(doc, dict) else None
    if not isinstance(doc, dict):
        problem = f"it holds a JSON {type(doc).__name__}, not an object"
    elif version is None:
        problem = "it has no schema_version"
    elif not isinstance(version, int) or isinstance(version, bool) or version < 1:
        problem = f"schema_version {version!r} is not a bench schema (1 to {SCHEMA_VERSION})"
    elif version > SCHEMA_VERSION:
        problem, hint = f"schema_version {version} is newer than this dflash reads ({SCHEMA_VERSION})", "upgrade dflash"
    else:
        missing = [key for key in ("settings", "dataset") if not isinstance(doc.get(key), dict)]
        if not any(isinstance(doc.get(key), dict) for key in (*(k for k, _ in MODE_SECTIONS), *ALIASES)):
            missing.append(f"mode section ({', '.join(k for k, _ in MODE_SECTIONS)})")
        if missing:
            problem = f"it has no {', no '.join(missing)}"
    if problem:
        raise DFlashError(f"{name} is not a dflash bench result: {problem}", hint=hint)


def upgrade_document(doc: dict[str, Any]) -> dict[str, Any]:
    """A document of any schema with its mode sections under the current names (a schema-1 document's
    "pld" section read as "lookup"); the document itself is left as it was."""
    doc = dict(doc)
    for old, name in ALIASES.items():
        if doc.get(name) is None and doc.get(old) is not None:
            doc[name] = doc[old]
    return doc
