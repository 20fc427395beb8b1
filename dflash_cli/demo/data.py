"""Token streams of the demo corpus, cached as .npy so training restarts instantly."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from dflash_cli.corpora.stdlib import read_text, split_sources


def corpus_texts(split: str, max_files: int = 0) -> list[str]:
    """Texts of a split in deterministic order; `max_files` > 0 keeps only the first files (smoke tests)."""
    files = getattr(split_sources(), split)
    files = files[:max_files] if max_files else files
    return [t for t in (read_text(p) for p in files) if t]


def token_stream(tokenizer_dir: Path, split: str, cache_dir: Path, max_files: int = 0) -> np.ndarray:
    """All files of a split, tokenized and joined with the end-of-text token."""
    cache = cache_dir / f"tokens-{split}.npy"
    if cache.exists():
        return np.load(cache)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    ids: list[int] = []
    for text in corpus_texts(split, max_files):
        ids.extend(tok(text)["input_ids"])
        ids.append(tok.eos_token_id)
    arr = np.asarray(ids, dtype=np.uint16)
    cache_dir.mkdir(parents=True, exist_ok=True)
    tmp = cache.with_suffix(".tmp.npy")
    np.save(tmp, arr)
    tmp.replace(cache)
    return arr
