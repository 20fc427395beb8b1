"""Continuous batching: the decoding loops of several requests, each on its own thread, share model calls.

Every request runs the ordinary loop (decoding/loops.py, any mode) against SlotSessions: a SlotSession
looks like a one-sequence session, but its `run` hands the call to the CallBatcher and waits. Once every
live request waits on a call (or a short grace period has passed), the batcher runs the calls of one
graph together (the target's or the draft's, whichever more requests wait on; the others wait a round
and so fall into step), in one batched call (backends/ort_batched.py), each request at its own position
in its own cache slot. Requests join and leave between calls, so a finished one
frees its slot at once and a newcomer's prefill chunks ride along with the others' steps.

Calls of very different lengths (a newcomer's 256-token prefill chunk beside 16-token verify blocks)
are not padded to one another: calls are grouped so that padding at most doubles a group's rows.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import numpy as np

from dflash_cli.backends.base import SessionTraits

GRACE_S = 0.05  # how long calls already waiting give a live request that has not called yet


@dataclass
class _Call:
    slot: int
    graph: str
    feeds: dict[str, np.ndarray]
    done: threading.Event = field(default_factory=threading.Event)
    result: dict | None = None
    error: BaseException | None = None


@dataclass
class BatchStats:
    """What /metrics reports: calls run and sequences they carried, per graph."""

    calls: dict[str, int] = field(default_factory=dict)
    sequences: dict[str, int] = field(default_factory=dict)
    largest: int = 0

    def add(self, graph: str, n: int) -> None:
        self.calls[graph] = self.calls.get(graph, 0) + 1
        self.sequences[graph] = self.sequences.get(graph, 0) + n
        self.largest = max(self.largest, n)

    def mean(self, graph: str) -> float:
        return self.sequences.get(graph, 0) / max(1, self.calls.get(graph, 0))


def _width(call: _Call) -> int:
    key = "context_position_ids" if call.graph == "draft" else "input_ids"
    return int(np.asarray(call.feeds[key]).shape[1])


def groups(calls: list[_Call]) -> list[list[_Call]]:
    """Calls of one graph whose lengths are close enough to share a call: sorted by length, a group grows
    while the longest is at most twice its shortest (or all are short)."""
    out = []
    for graph in sorted({c.graph for c in calls}):
        group: list[_Call] = []
        for call in sorted((c for c in calls if c.graph == graph), key=_width):
            if group and _width(call) > max(2 * _width(group[0]), 4):
                out.append(group)
                group = []
            group.append(call)
        out.append(group)
    return out


class CallBatcher:
    def __init__(self, graphs: dict[str, object], grace_s: float = GRACE_S) -> None:
        self.graphs, self.grace_s = graphs, grace_s
        self.stats = BatchStats()
        self._cond = threading.Condition()
        self._live: set[int] = set()
        self._pending: dict[int, _Call] = {}
        self._closed = False
        self._thread = threading.Thread(target=self._dispatch, name="dflash-batcher", daemon=True)
        self._thread.start()

    def enter(self, slot: int) -> None:
        with self._cond:
            self._live.add(slot)

    def leave(self, slot: int) -> None:
        with self._cond:
            self._live.discard(slot)
            self._cond.notify_all()  # the others may all be waiting for this one

    def live(self) -> int:
        """Requests decoding now (each shares the calls of the others)."""
        return max(1, len(self._live))

    def call(self, slot: int, graph: str, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        c = _Call(slot, graph, feeds)
        with self._cond:
            if self._closed:
                raise RuntimeError("the batcher was closed (server shutting down)")
            self._pending[slot] = c
            self._cond.notify_all()
        c.done.wait()
        if c.error is not None:
            raise c.error
        return c.result

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def _dispatch(self) -> None:
        while True:
            with self._cond:
                first = None
                while not self._closed:
                    if self._pending:
                        first = first or time.monotonic()
                        left = self.grace_s - (time.monotonic() - first)
                        if len(self._pending) >= len(self._live) or left <= 0:
                            break
                        self._cond.wait(left)
                    else:
                        first = None
                        self._cond.wait()
                if self._closed:  # requests still waiting hear of it rather than wait forever
                    for c in self._pending.values():
                        c.error = RuntimeError("the batcher was closed (server shutting down)")
                        c.done.set()
                    return
                # One graph per round, the one most requests wait on: the others' calls wait a round and then
                # meet the rest in step (a request drafting while another verifies would stay out of phase).
                waiting = list(self._pending.values())
                counts = {g: sum(c.graph == g for c in waiting) for g in {c.graph for c in waiting}}
                graph = max(sorted(counts), key=lambda g: counts[g])
                batch = [c for c in waiting if c.graph == graph]
                self._pending = {c.slot: c for c in waiting if c.graph != graph}
            for group in groups(batch):
                self._run(group)

    def _run(self, group: list[_Call]) -> None:
        try:
            results = self.graphs[group[0].graph].run([c.slot for c in group], [c.feeds for c in group])
            self.stats.add(group[0].graph, len(group))
            for c, r in zip(group, results):
                c.result = r
        except BaseException as exc:  # every request of the group hears of it; the batcher keeps serving
            for c in group:
                c.error = exc
        for c in group:
            c.done.set()


class SlotSession(SessionTraits):
    """One request's view of a batched graph: the one-sequence session interface, calls batched."""

    vision = None  # image prompts are served one at a time

    def __init__(self, batcher: CallBatcher, graph: str, slot: int) -> None:
        self.batcher, self.name, self.slot = batcher, graph, slot
        self.ctx_len = batcher.graphs[graph].ctx_len
        # ONNX Runtime's graphs take calls of any length; a QAIC program its compiled ones (qaic/slots.py)
        self.variable_length = batcher.graphs[graph].variable_length
        self.input_names = list(getattr(batcher.graphs[graph], "input_names", ()))

    @property
    def sharing(self) -> int:
        """The sequences whose calls this one's share: what a second added to a call costs is their total rate."""
        return self.batcher.live()

    def reset(self, fill: float = 0.0) -> None:
        """Nothing to clear: no call reads a slot at or beyond its own first position."""

    def run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return self.batcher.call(self.slot, self.name, feeds)
