"""Distillation data for the demo draft: the target's own greedy continuations of corpus prompts."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch


def docstring_ends(tokens: np.ndarray, token_texts: list[str]) -> np.ndarray:
    """Indices of tokens that end a line closing a docstring (`...\"\"\"` + newline).

    A function's signature and docstring is what a HumanEval-style prompt looks like; cutting
    corpus prompts there shows the draft what the target writes after a docstring.
    """
    ends = []
    for i in range(2, len(tokens)):
        text = token_texts[tokens[i]]
        k = text.find("\n")  # byte-level BPE merges the newline with what follows it
        if k >= 0 and (token_texts[tokens[i - 2]] + token_texts[tokens[i - 1]] + text[:k]).endswith('"""'):
            ends.append(i)
    return np.asarray(ends, dtype=np.int64)


def prompt_starts(
    tokens: np.ndarray,
    newline_ids: set[int],
    n: int,
    prompt_len: int,
    total_len: int,
    rng,
    ends: np.ndarray | None = None,
) -> np.ndarray:
    """Window starts whose prompt ends right after a newline token (like a real code prompt).

    With `ends`, the prompt's last token is drawn from those indices instead.
    """
    if ends is not None:
        ok = ends[(ends >= prompt_len - 1) & (ends + total_len - prompt_len + 1 < len(tokens))]
        if len(ok) < n:
            raise SystemExit(f"only {len(ok)} usable prompt ends for a batch of {n}: use --prompt-style newline")
        return rng.choice(ok, size=n, replace=False) - (prompt_len - 1)
    starts = []
    while len(starts) < n:
        s = int(rng.integers(0, len(tokens) - total_len - 1))
        if int(tokens[s + prompt_len - 1]) in newline_ids:
            starts.append(s)
    return np.asarray(starts)


@torch.no_grad()
def generate_continuations(
    target,
    tokens: np.ndarray,
    newline_ids: set[int],
    *,
    n_seqs: int,
    new_tokens: int,
    seed: int,
    out_path: Path,
    batch_size: int = 64,
    prompt_lens: tuple[int, ...] = (16, 32, 48, 64, 96),
    ends: np.ndarray | None = None,
    log=None,
) -> np.ndarray:
    """Greedy continuations, appended batch by batch to a resumable .npy-per-batch store."""
    out_path.mkdir(parents=True, exist_ok=True)
    target.eval()
    batches = []
    n_batches = (n_seqs + batch_size - 1) // batch_size
    for bi in range(n_batches):
        f = out_path / f"batch-{bi:05d}.npy"
        if f.exists():
            batches.append(np.load(f))
            continue
        rng = np.random.default_rng([seed, bi])
        prompt_len = int(rng.choice(prompt_lens))
        starts = prompt_starts(tokens, newline_ids, batch_size, prompt_len, prompt_len + new_tokens, rng, ends)
        prompts = torch.from_numpy(np.stack([tokens[s : s + prompt_len] for s in starts]).astype(np.int64))
        out = target.generate(
            input_ids=prompts,
            attention_mask=torch.ones_like(prompts),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            eos_token_id=None,
            pad_token_id=0,
        )
        arr = np.concatenate([np.full((len(out), 1), prompt_len, dtype=np.int64), out.numpy()], axis=1)
        tmp = f.with_suffix(".tmp.npy")
        np.save(tmp, arr.astype(np.int32))
        tmp.replace(f)
        batches.append(arr.astype(np.int32))
        if log:
            print(
                json.dumps({"distill_batch": bi + 1, "of": n_batches, "prompt_len": prompt_len}), file=log, flush=True
            )
    return batches
