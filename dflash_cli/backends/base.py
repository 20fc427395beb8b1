"""The session interface every backend implements.

A session owns one compiled graph in the retained-state convention: the caller feeds only the
non-cache inputs (`input_ids`, `position_ids`, ...) and the session keeps every `past_*` input
(`past_key.{i}` / `past_value.{i}`, a hybrid target's linear-attention states) wired to the previous
call's `*_RetainedState` outputs, never copying them to the caller.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np


class SessionTraits:
    """What a backend's session declares about itself. Decoding and serving branch on these, never on the
    backend's name; a session class inherits the defaults (ONNX Runtime's static graphs) and overrides what
    differs."""

    variable_length: bool = False
    """True where a call may carry any number of tokens (callers then skip padding to the graph's fixed
    length: prefill chunks and verify blocks carry only their real rows); False: fixed shapes."""

    compiled_slots: bool = False
    """True where the compiled program itself holds the caches of the sequences it batches (QAIC's
    compile.qaic.full_batch_size): continuous batching runs on those slots (qaic/slots.py), as many as
    were compiled, instead of on host-side batched sessions (backends/ort_batched.py)."""

    host_checked: bool = True
    """False where the build could not run this session's graph to check it (a program compiled for a card,
    built without one): checks such as batch invariance then have to run where the session opens."""


class Session(Protocol):
    name: str  # "target" | "draft"
    input_names: list[str]  # non-cache inputs
    output_names: list[str]  # non-cache outputs
    # SessionTraits (a session class inherits them with their defaults)
    variable_length: bool
    compiled_slots: bool
    host_checked: bool

    def reset(self) -> None:
        """Zero the retained KV cache (start of a new sequence)."""

    def run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """One call; cache inputs come from the previous call's retained-state outputs."""


def is_cache_input(name: str) -> bool:
    """K/V caches, and a hybrid target's linear-attention states (past_conv.i, past_recurrent.i, ...)."""
    return name.startswith("past_")


def is_kv_input(name: str) -> bool:
    return name.startswith(("past_key.", "past_value."))


def retained_name(cache_input: str) -> str:
    return f"{cache_input}_RetainedState"


def drafts_any_rows(inputs) -> bool:
    """Whether a draft graph (ONNX Runtime's input list) drafts a block of any length: its input_ids' axis 1 is
    the symbolic `block_len` (graph revision 12 on, a DFlash draft's prefix graph)."""
    from dflash_cli.exporting.names import BLOCK_ROWS

    return any(i.name == "input_ids" and len(i.shape) > 1 and i.shape[1] == BLOCK_ROWS for i in inputs)


def proposal_rows(n: int, batch: int = 1) -> np.ndarray:
    """The `proposal_rows` feed asking a DFlash draft's prefix graph for n proposals (only its shape is read)."""
    return np.zeros((batch, n), np.int64)


def with_proposal_rows(feeds: dict[str, np.ndarray], input_names) -> dict[str, np.ndarray]:
    """`feeds` with `proposal_rows` where the graph takes it and the caller left it out: every proposal of the
    block, as graphs before revision 15 gave."""
    from dflash_cli.exporting.names import PROPOSAL_ROWS

    if PROPOSAL_ROWS not in input_names or PROPOSAL_ROWS in feeds:
        return feeds
    ids = np.asarray(feeds["input_ids"])
    return {**feeds, PROPOSAL_ROWS: proposal_rows(ids.shape[1] - 1, ids.shape[0])}
