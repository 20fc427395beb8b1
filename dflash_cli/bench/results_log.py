"""Resumable per-sample bench results: a JSONL file, one header line then one line per finished turn.

Each line is written whole, flushed and fsynced before the next generation starts, so a killed
run loses at most the turn in flight. On `--resume` the finished turns are read back (by sample
id and turn) and skipped; a truncated last line (killed mid-write) is dropped and rewritten.
The header holds the settings that make results comparable; resuming under other settings is
refused, because mixing them would silently corrupt the averages.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from pathlib import Path
from typing import Any, TextIO

from dflash_cli.decoding.modes import canonical as canonical_mode
from dflash_cli.decoding.result import GenerationResult
from dflash_cli.errors import DFlashError

# Logs written before the mode renames (decoding/modes.py ALIASES: lookup was "pld") are schema 1 too:
# they are read with every mode under its current name, so such a run still resumes.
LOG_SCHEMA_VERSION = 1

TurnKey = tuple[str, int, int]  # (sample id, turn index, repetition)

_RESULT_FIELDS = {f.name for f in dataclasses.fields(GenerationResult)}


def default_results_path(cache_root: Path, recipe: str, dataset: str, block_size: int) -> Path:
    """`<cache>/bench/<recipe>-<dataset>-b<B>.jsonl`: one file per comparable run, so --resume finds it."""
    stem = re.sub(r"[^A-Za-z0-9._-]+", "_", f"{recipe}-{dataset}-b{block_size}")
    return Path(cache_root) / "bench" / f"{stem}.jsonl"


def result_from_dict(data: dict[str, Any]) -> GenerationResult:
    """Inverse of GenerationResult.to_dict(): derived fields (tau, new_tokens, ...) are dropped."""
    return GenerationResult(**{k: v for k, v in data.items() if k in _RESULT_FIELDS})


def _current_modes(record: dict[str, Any]) -> dict[str, Any]:
    """A turn record with its results keyed (and their `mode` named) by the modes' current names."""
    results = record.get("results")
    if not isinstance(results, dict):
        return record
    renamed = {}
    for mode, data in results.items():
        if isinstance(data, dict) and "mode" in data:
            data = {**data, "mode": canonical_mode(data["mode"])}
        renamed[canonical_mode(mode)] = data
    return {**record, "results": renamed}


def _canonical(value: Any) -> Any:
    # Compare settings as they read back from JSON (tuples become lists, keys become strings).
    return json.loads(json.dumps(value, sort_keys=True))


class ResultsLog:
    """The JSONL results file of one bench run (one engine, one block size)."""

    def __init__(self, path: Path | str, *, resume: bool = False) -> None:
        self.path = Path(path)
        self.resume = resume
        self._handle: TextIO | None = None

    def start(self, header: dict[str, Any]) -> dict[TurnKey, dict[str, Any]]:
        """Open for appending; return the finished turn records when resuming, else start afresh."""
        header = _canonical(header)
        finished: dict[TurnKey, dict[str, Any]] = {}
        existing = self._read_existing() if self.resume else None
        if existing is not None:
            old_header, records, good_bytes = existing
            self._check_header(old_header, header)
            for record in records:
                finished.setdefault((record["sample_id"], record["turn"], record.get("rep", 0)), record)
            with self.path.open("r+b") as handle:  # drop a torn last line before appending
                handle.truncate(good_bytes)
            self._handle = self.path.open("a", encoding="utf-8")
        else:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._handle = self.path.open("w", encoding="utf-8")
            self._write_line({"type": "header", "schema_version": LOG_SCHEMA_VERSION, "settings": header})
        return finished

    def append(self, record: dict[str, Any]) -> None:
        """Write one finished turn durably (flush + fsync) before the bench moves on."""
        self._write_line({"type": "turn", **record})

    def close(self) -> None:
        if self._handle is not None:
            self._handle.close()
            self._handle = None

    def __enter__(self) -> ResultsLog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _write_line(self, obj: dict[str, Any]) -> None:
        if self._handle is None:
            raise RuntimeError("ResultsLog.start() must be called before writing")
        self._handle.write(json.dumps(obj, sort_keys=True) + "\n")
        self._handle.flush()
        os.fsync(self._handle.fileno())

    def _read_existing(self) -> tuple[dict[str, Any], list[dict[str, Any]], int] | None:
        """(header settings, turn records, bytes of complete lines), or None when nothing usable exists."""
        try:
            data = self.path.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise DFlashError(f"cannot read results file {self.path}: {exc.strerror or exc}") from exc
        # Only newline-terminated lines are complete; the tail after the last newline was torn.
        good_bytes = data.rfind(b"\n") + 1
        lines = data[:good_bytes].decode("utf-8", errors="replace").splitlines()
        if not lines:
            return None  # killed while writing the header: nothing to keep
        parsed = [self._parse(lineno, line) for lineno, line in enumerate(lines, start=1) if line.strip()]
        header, records = parsed[0], parsed[1:]
        if header.get("type") != "header" or header.get("schema_version") != LOG_SCHEMA_VERSION:
            raise DFlashError(
                f"{self.path} is not a dflash bench results file of schema {LOG_SCHEMA_VERSION}",
                hint="pass another --results file, or run without --resume to overwrite it",
            )
        turns = [_current_modes(r) for r in records if r.get("type") == "turn"]
        for record in turns:
            if not isinstance(record.get("sample_id"), str) or not isinstance(record.get("turn"), int):
                raise DFlashError(f"{self.path}: a result line lacks sample_id/turn", hint="run without --resume")
        settings = dict(header.get("settings", {}))
        if isinstance(settings.get("modes"), list):
            settings["modes"] = [canonical_mode(m) for m in settings["modes"]]
        return settings, turns, good_bytes

    def _parse(self, lineno: int, line: str) -> dict[str, Any]:
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise DFlashError(
                f"results file {self.path} is corrupt at line {lineno}: {exc.msg}",
                hint="run without --resume to start over, or pass another --results file",
            ) from exc
        if not isinstance(obj, dict):
            raise DFlashError(
                f"results file {self.path} line {lineno} is not a JSON object", hint="run without --resume"
            )
        return obj

    def _check_header(self, old: dict[str, Any], new: dict[str, Any]) -> None:
        changed = sorted(k for k in set(old) | set(new) if old.get(k) != new.get(k))
        if changed:
            detail = "; ".join(f"{k}: {old.get(k)!r} -> {new.get(k)!r}" for k in changed)
            raise DFlashError(
                f"cannot resume {self.path}: settings differ from the interrupted run ({detail})",
                hint="rerun with the original settings, drop --resume to start over, or pass another --results file",
            )
