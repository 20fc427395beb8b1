"""fp16 emulation at every position the cache holds, per position band, the way a card would run it.

Two measurements on the fp16-converted graphs (readiness.fp16.to_fp16) against the fp32 ones:

* teacher-forced: one long token sequence goes through the target in prefill chunks, each chunk
  ending in padding rows (position -1) as a prompt that is not a multiple of the prefill length
  does; per position, fp16 argmax vs fp32 argmax and the context-feature error, grouped into bands
  (0-256, 256-1k, 1k-2k, 2k-4k, ...).
* end to end: greedy DFlash (target and draft) from prompts placed so that generation runs inside
  each band, and across position 2048 when the cache reaches past it; identical or not.

The fp16 sessions start from a cache full of NaN, not zeros: on a card the retained buffers hold
whatever the device memory held (the host never feeds them), so the graph must ignore every slot
no query can see. Padding rows, long positions and stale slots are exactly where -convert-to-fp16
breaks graphs that pass in fp32 (see readiness.fp16_lint for the patterns).
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from dflash_cli.readiness.fp16 import NonfiniteWatch, detect_nonfinite, to_fp16

BAND_EDGES = (0, 256, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)
MIN_AGREEMENT = 0.95  # teacher-forced argmax agreement a band needs (near-ties flip in fp16)
MAX_FEATURE_ERROR = 0.05  # largest |fp16 - fp32| of a context feature, relative to the row's largest |fp32|
STALE_FILL = float("nan")


@dataclass
class Band:
    lo: int
    hi: int
    positions: int = 0  # teacher-forced positions compared
    agree: int = 0  # of them, fp16 argmax == fp32 argmax
    max_feature_error: float = 0.0
    nonfinite: int = 0  # NaN/inf values in fp16 outputs of calls starting in this band (padding rows too)
    generations: int = 0  # end-to-end placements generating in this band
    identical: int = 0  # of them, fp16 output == fp32 output

    @property
    def label(self) -> str:
        return f"{_k(self.lo)}-{_k(self.hi)}"

    @property
    def agreement(self) -> float:
        return self.agree / self.positions if self.positions else 0.0

    @property
    def ok(self) -> bool:
        return (
            self.positions > 0
            and self.nonfinite == 0
            and self.agreement >= MIN_AGREEMENT
            and self.max_feature_error <= MAX_FEATURE_ERROR
        )

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "band": self.label, "agreement": self.agreement, "ok": self.ok}


@dataclass
class BandReport:
    ctx_len: int
    prefill_seq_len: int
    padding_rows: int  # per prefill chunk
    stale: bool = True  # fp16 caches start as NaN (False: zeros, as ONNX Runtime starts them)
    bands: list[Band] = field(default_factory=list)
    placements: list[dict[str, Any]] = field(default_factory=list)  # end-to-end: start, tokens, identical

    @property
    def ok(self) -> bool:
        return bool(self.bands) and all(b.ok for b in self.bands)

    def to_dict(self) -> dict[str, Any]:
        return {
            "ctx_len": self.ctx_len,
            "prefill_seq_len": self.prefill_seq_len,
            "padding_rows": self.padding_rows,
            "stale_cache_fill": "nan" if self.stale else "zeros",
            "thresholds": {"min_agreement": MIN_AGREEMENT, "max_feature_error": MAX_FEATURE_ERROR},
            "bands": [b.to_dict() for b in self.bands],
            "placements": self.placements,
            "ok": self.ok,
        }

    def render_text(self) -> str:
        lines = [
            f"fp16 emulation by position band (ctx_len {self.ctx_len}, prefill chunks of {self.prefill_seq_len} "
            f"ending in {self.padding_rows} padding rows, cache starting as {'NaN' if self.stale else 'zeros'}):"
        ]
        for b in self.bands:
            gen = f", generations identical {b.identical}/{b.generations}" if b.generations else ""
            lines.append(
                f"  {b.label:>9}: argmax agreement {b.agreement:6.1%} of {b.positions}, largest feature error "
                f"{b.max_feature_error:.2e}, non-finite {b.nonfinite}{gen} -> {'ok' if b.ok else 'FAIL'}"
            )
        return "\n".join(lines)


def _k(n: int) -> str:
    return f"{n // 1024}k" if n and n % 1024 == 0 else str(n)


def make_bands(ctx_len: int) -> list[Band]:
    """Bands covering positions 0 .. ctx_len - 2 (the last slot is the padding's spare)."""
    top = ctx_len - 1
    edges = [e for e in BAND_EDGES if e < top] + [top]
    return [Band(lo, hi) for lo, hi in zip(edges, edges[1:])]


def _band_of(bands: list[Band], position: int) -> Band:
    return next(b for b in bands if b.lo <= position < b.hi)


def teacher_forced(
    target32: Any,
    target16: Any,
    tokens: Sequence[int],
    bands: list[Band],
    prefill_seq_len: int,
    padding_rows: int,
    stale: bool = True,
    progress: Callable[[int, int], None] | None = None,
) -> None:
    """Feed `tokens` through both targets chunk by chunk and fill each band's comparison."""
    target32.reset()
    target16.reset(fill=STALE_FILL if stale else 0.0)
    real = prefill_seq_len - padding_rows
    n = min(len(tokens), bands[-1].hi)
    if not padding_rows:  # no padding at all: drop the partial last chunk rather than pad it
        n -= n % prefill_seq_len
    for start in range(0, n, real):
        count = min(real, n - start)
        ids = np.zeros((1, prefill_seq_len), np.int64)
        ids[0, :count] = tokens[start : start + count]
        pos = np.full((1, prefill_seq_len), -1, np.int64)
        pos[0, :count] = np.arange(start, start + count)
        feeds = {"input_ids": ids, "position_ids": pos}
        ref, got = target32.run(feeds), target16.run(feeds)
        _band_of(bands, start).nonfinite += sum(detect_nonfinite(got).values())
        ref_f, got_f = ref["context_features"][0], got["context_features"][0]
        for j in range(count):
            band = _band_of(bands, start + j)
            band.positions += 1
            band.agree += int(ref["tokens"][0, j] == got["tokens"][0, j])
            scale = float(np.abs(ref_f[j]).max()) or 1.0
            with np.errstate(invalid="ignore"):
                err = float(np.abs(got_f[j] - ref_f[j]).max()) / scale
            band.max_feature_error = max(band.max_feature_error, err if np.isfinite(err) else float("inf"))
        if progress:
            progress(start + count, n)


def placements(ctx_len: int, max_new_tokens: int, bands: list[Band]) -> list[int]:
    """Prompt lengths putting generation in the middle of each band, and across 2048 when it fits."""
    starts = []
    for b in bands:
        if b.hi - b.lo > max_new_tokens + 8:
            starts.append(max(8, (b.lo + b.hi - max_new_tokens) // 2))
    if ctx_len - 1 > 2048 + max_new_tokens:
        starts.append(2048 - max_new_tokens // 2)
    # +3: never a multiple of the prefill length, so the last prefill chunk is padded
    return sorted({s + 3 for s in starts})


def fp16_bands(
    engine: Any,
    export_dir: Path,
    tokens: Sequence[int],
    *,
    max_new_tokens: int = 48,
    padding_rows: int | None = None,
    stale: bool = True,
    end_to_end: bool = True,
    progress: Callable[[str, int, int], None] | None = None,
) -> BandReport:
    """Judge the graphs of `export_dir` (fp32 reference and fp16 emulation both opened from it).

    `engine` supplies the decoding loop and its settings (block size, stop tokens); its own
    sessions are put back afterwards. `tokens`: a long text, tokenized; it should cover the cache.
    `padding_rows=0` and `stale=False` switch padding and the NaN cache off, to tell causes apart.
    """
    from dflash_cli.backends.ort import OrtSession

    export_dir = Path(export_dir)
    info = json.loads((export_dir / "export.json").read_text())
    ctx_len, prefill = int(info["ctx_len"]), int(info["prefill_seq_len"])
    pad = padding_rows if padding_rows is not None else max(1, prefill // 8)
    report = BandReport(ctx_len, prefill, pad, stale, bands=make_bands(ctx_len))
    own = (engine.target, engine.draft)
    with tempfile.TemporaryDirectory(prefix="dflash-fp16-bands-") as tmp:
        s32 = {g: OrtSession(export_dir / info["graphs"][g]["onnx"], g) for g in ("target", "draft")}
        s16 = {
            g: OrtSession(to_fp16(export_dir / info["graphs"][g]["onnx"], Path(tmp) / f"{g}.onnx"), g)
            for g in ("target", "draft")
        }
        teacher_forced(
            s32["target"],
            s16["target"],
            tokens,
            report.bands,
            prefill,
            pad,
            stale,
            progress=(lambda i, n: progress("teacher-forced", i, n)) if progress else None,
        )
        starts = [s for s in placements(ctx_len, max_new_tokens, report.bands) if s <= len(tokens)]
        starts = starts if end_to_end else []
        try:
            for k, start in enumerate(starts):
                ids = list(tokens[:start])
                engine.target, engine.draft = s32["target"], s32["draft"]
                ref = engine.generate(ids, mode="dflash", max_new_tokens=max_new_tokens).tokens
                counts: dict[str, int] = {}
                fill = STALE_FILL if stale else 0.0
                engine.target, engine.draft = (
                    NonfiniteWatch(s16[g], counts, reset_fill=fill) for g in ("target", "draft")
                )
                got = engine.generate(ids, mode="dflash", max_new_tokens=max_new_tokens).tokens
                same = got == ref
                first = None if same else next((j for j, (a, b) in enumerate(zip(got, ref)) if a != b), len(ref))
                band = _band_of(report.bands, min(start + max(len(ref) - 1, 0), report.bands[-1].hi - 1))
                band.generations += 1
                band.identical += int(same)
                band.nonfinite += sum(counts.values())
                report.placements.append(
                    {
                        "prompt_tokens": start,
                        "generated": len(ref),
                        "positions": [start, start + len(ref)],
                        "identical": same,
                        "first_divergence": None if first is None else start + first,
                        "nonfinite": counts,
                    }
                )
                if progress:
                    progress("end to end", k + 1, len(starts))
        finally:
            engine.target, engine.draft = own
    return report


def corpus_tokens(encode: Callable[[str], list[int]], count: int) -> list[int]:
    """At least `count` tokens of real text: held-out standard-library sources (the demo never trains
    on them), concatenated in a fixed order; fewer only if the whole held-out set is shorter."""
    from dflash_cli.corpora.stdlib import split_sources

    tokens: list[int] = []
    for path in split_sources().heldout:
        tokens += encode(path.read_text(encoding="utf-8", errors="replace"))
        if len(tokens) >= count:
            break
    return tokens[:count]
