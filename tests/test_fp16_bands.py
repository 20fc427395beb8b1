"""fp16 emulation per position band: the bands, the placements, and verdicts that can fail."""

from __future__ import annotations

import numpy as np

from dflash_cli.readiness.fp16_bands import Band, corpus_tokens, fp16_bands, make_bands, placements, teacher_forced


def test_bands_cover_the_cache_and_placements_cross_2048() -> None:
    bands = make_bands(4096)
    assert [(b.lo, b.hi) for b in bands] == [(0, 256), (256, 1024), (1024, 2048), (2048, 4095)]
    starts = placements(4096, 48, bands)
    assert any(s < 2048 < s + 48 for s in starts)  # one generation crosses position 2048
    assert all(s % 64 for s in starts)  # prompts are never a multiple of the prefill length
    assert [(b.lo, b.hi) for b in make_bands(128)] == [(0, 127)]


class _Session:
    """A stand-in target: tokens = ids + 1, features from the ids; `broken` returns NaN past a position."""

    def __init__(self, broken_from: int | None = None) -> None:
        self.broken_from = broken_from
        self.fills: list[float] = []

    def reset(self, fill: float = 0.0) -> None:
        self.fills.append(fill)

    def run(self, feeds: dict) -> dict:
        ids, pos = feeds["input_ids"], feeds["position_ids"]
        feats = np.repeat(ids[..., None].astype(np.float32), 4, axis=-1)
        if self.broken_from is not None:
            feats[pos >= self.broken_from] = np.nan
        return {"tokens": ids + 1, "context_features": feats}


def test_teacher_forced_passes_equal_sessions_and_fails_nan_bands() -> None:
    tokens = list(range(1, 300))
    good = make_bands(512)
    ref, same = _Session(), _Session()
    teacher_forced(ref, same, tokens, good, prefill_seq_len=16, padding_rows=3)
    assert same.fills and np.isnan(same.fills[0]) and ref.fills == [0.0]  # the emulated cache starts as NaN
    assert all(b.ok for b in good[:2]) and good[0].positions == 256 and good[1].positions == 299 - 256
    bad = make_bands(512)
    teacher_forced(_Session(), _Session(broken_from=260), tokens, bad, prefill_seq_len=16, padding_rows=3)
    assert bad[0].ok and not bad[1].ok and bad[1].nonfinite > 0


def test_band_verdict_thresholds() -> None:
    band = Band(0, 256, positions=100, agree=96, max_feature_error=0.01)
    assert band.ok
    assert not Band(0, 256, positions=100, agree=90).ok
    assert not Band(0, 256, positions=100, agree=100, max_feature_error=0.2).ok
    assert not Band(0, 256, positions=100, agree=100, nonfinite=1).ok
    assert not Band(0, 256).ok  # nothing compared is not a pass


def test_tiny_pair_passes_end_to_end(qwen3_engine) -> None:
    engine = qwen3_engine
    tokens = corpus_tokens(lambda text: list(engine.tokenizer(text)["input_ids"]), engine.ctx_len)
    assert len(tokens) == engine.ctx_len
    report = fp16_bands(engine, engine.export_dir, tokens, max_new_tokens=16)
    assert report.ok, report.render_text()
    assert report.placements and all(p["identical"] for p in report.placements)
    assert engine.target.__class__.__name__ != "NonfiniteWatch"  # the engine's own sessions are back
    doc = report.to_dict()
    assert doc["stale_cache_fill"] == "nan" and doc["ok"] is True
