"""The datasets the field reports speculative decoding on, by name, read offline.

`--dataset gsm8k` (or math500, mbpp, mt-bench, alpaca) reads, in this order:
1. `<datasets dir>/<name>.jsonl`: the Hugging Face dataset's own rows (its columns, one JSON object
   per line), where the datasets dir is $DFLASH_DATASETS_DIR, else `<cache root>/datasets`;
2. the local Hugging Face `datasets` cache, through the `datasets` library in offline mode (an
   optional extra: `pip install 'dflash-toolchain[datasets]'`).
Nothing is downloaded. Prompts are formatted as z-lab's `benchmark.py` formats them (gsm8k and
math500 append the step-by-step / \\boxed{} instruction; mbpp and mt-bench use the prompt field,
mt-bench as several turns). alpaca is not in z-lab's list: its prompt is the instruction, then the
input (when there is one) after a blank line.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dflash_cli.errors import DatasetError

_REASON = "\nPlease reason step by step, and put your final answer within \\boxed{}."


@dataclass(frozen=True)
class NamedDataset:
    repo: str
    config: str | None
    split: str
    turns: Callable[[dict[str, Any]], list[str]]
    id_field: str | None = None


def _alpaca(row: dict[str, Any]) -> list[str]:
    extra = (row.get("input") or "").strip()
    return [row["instruction"] + (f"\n\n{extra}" if extra else "")]


NAMED_DATASETS: dict[str, NamedDataset] = {
    "gsm8k": NamedDataset("openai/gsm8k", "main", "test", lambda r: [r["question"] + _REASON]),
    "math500": NamedDataset("HuggingFaceH4/MATH-500", None, "test", lambda r: [r["problem"] + _REASON], "unique_id"),
    "mbpp": NamedDataset("google-research-datasets/mbpp", "sanitized", "test", lambda r: [r["prompt"]], "task_id"),
    "mt-bench": NamedDataset("HuggingFaceH4/mt_bench_prompts", None, "train", lambda r: list(r["prompt"]), "prompt_id"),
    "alpaca": NamedDataset("tatsu-lab/alpaca", None, "train", _alpaca),
}


def datasets_dir() -> Path:
    env = os.environ.get("DFLASH_DATASETS_DIR")
    if env:
        return Path(env).expanduser()
    home = os.environ.get("DFLASH_HOME")
    return (Path(home).expanduser() if home else Path.home() / ".cache" / "dflash") / "datasets"


def load_named(name: str) -> list[tuple[str, list[str]]]:
    """(sample id, turns) for every row of the named dataset, from a local file or the HF cache."""
    spec = NAMED_DATASETS[name]
    local = datasets_dir() / f"{name}.jsonl"
    if local.is_file():
        rows = _read_rows(local)
        where = str(local)
    else:
        rows = _from_hf_cache(spec)
        where = f"the Hugging Face datasets cache ({spec.repo})"
        if rows is None:
            config = f", config {spec.config}" if spec.config else ""
            raise DatasetError(
                f"dataset {name!r} is not available offline: looked for {local} and for {spec.repo}"
                f"{config}, split {spec.split} in the Hugging Face datasets cache",
                hint=f"put the dataset's rows (one JSON object per line, its own columns) in {local}, or "
                f"load {spec.repo} once with the `datasets` library on a machine with network and copy its cache",
            )
    samples = []
    for i, row in enumerate(rows):
        try:
            turns = spec.turns(row)
        except (KeyError, TypeError) as exc:
            raise DatasetError(
                f"{where}: row {i + 1} lacks the field {exc} that {name} prompts are made from",
                hint=f"the rows must have {spec.repo}'s columns",
            ) from None
        if not turns or not all(isinstance(t, str) and t.strip() for t in turns):
            raise DatasetError(f"{where}: row {i + 1} gives an empty prompt")
        sample_id = str(row[spec.id_field]) if spec.id_field and row.get(spec.id_field) is not None else str(i)
        samples.append((f"{name}/{sample_id}", turns))
    return samples


def _read_rows(path: Path) -> list[dict[str, Any]]:
    rows = []
    with path.open(encoding="utf-8") as handle:
        for lineno, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DatasetError(f"malformed JSON on line {lineno} of {path}: {exc.msg}") from None
            if not isinstance(row, dict):
                raise DatasetError(f"line {lineno} of {path} is not a JSON object")
            rows.append(row)
    return rows


def _from_hf_cache(spec: NamedDataset) -> list[dict[str, Any]] | None:
    try:
        import datasets
    except ImportError:
        return None
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # a cache lookup, never a download
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    try:
        args = (spec.repo, spec.config) if spec.config else (spec.repo,)
        return [dict(row) for row in datasets.load_dataset(*args, split=spec.split)]
    except Exception:  # not cached (the library raises several kinds): report where we looked
        return None
