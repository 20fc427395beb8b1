"""Trace an export's graphs in a forked process while this one writes the target's weights.

An export traces four one-layer templates (target and draft, each static and prefix-cache), seconds of
single-threaded Python each, and streams gigabytes of weights, mostly outside the GIL. With a second
core, a forked child traces every template, in order, while the parent writes the target's weights
(graphs.py): on the 4B-shaped pair this saved over a fifth of the export's wall time
(benchmarks/results/simplify/). Each template is handed back without weight bytes (its weights become
placeholders the parent points at the checkpoint again), through a file, so the child never waits for
the parent to read. Whatever happens to the child (an exception, a kill, a hang) the parent traces
what it did not get itself, so the graphs never depend on it. DFLASH_EXPORT_WORKERS=0 traces in process.
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
import shutil
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from dflash_cli.exporting.names import WRAPPER_PREFIX
from dflash_cli.exporting.torch_to_onnx import lazy_weight

PLACEHOLDER = "dflash-weight-placeholder"  # external-data location of a weight on its way between processes
# A child that delivers nothing for max(WAIT_FLOOR_S, PATIENCE x the parent's own slowest trace) is stuck.
WAIT_FLOOR_S = 120.0
PATIENCE = 10.0


def usable() -> bool:
    """Fork exists, more than one core is ours, and DFLASH_EXPORT_WORKERS is not 0."""
    if os.environ.get("DFLASH_EXPORT_WORKERS", "1") == "0":
        return False
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return cores >= 2 and "fork" in multiprocessing.get_all_start_methods()


def pack(model, by_graph_name: dict) -> bytes:
    """The template as bytes: weight initializers as placeholders, plus their names. Consumes `model`."""
    import onnx_ir as ir

    weights = []
    for value in model.graph.initializers.values():
        if value.name in by_graph_name:
            old = value.const_value
            value.const_value = ir.ExternalTensor(PLACEHOLDER, 0, 0, old.dtype, shape=old.shape, name=value.name)
            weights.append(value.name)
    return pickle.dumps((ir.serde.serialize_model(model).SerializeToString(), weights))


def unpack(blob: bytes, sources: dict) -> tuple[Any, dict]:
    """`pack`'s inverse: the template with its weights read lazily from `sources` again."""
    import onnx
    import onnx_ir as ir

    raw, weights = pickle.loads(blob)  # noqa: S301 - bytes from our own forked child
    model = ir.serde.deserialize_model(onnx.ModelProto.FromString(raw))
    by_graph_name = {}
    inits = model.graph.initializers
    for name in weights:
        src = sources[name.removeprefix(WRAPPER_PREFIX)]
        old = inits[name].const_value
        inits[name].const_value = lazy_weight(src, old.dtype, tuple(old.shape), name)
        by_graph_name[name] = src
    return model, by_graph_name


class TraceWorker:
    """A forked child running `trace(job)` for each of `jobs` in order; `take(i, ...)` returns job i's
    (model, by_graph_name, seconds), or None when the child could not deliver it."""

    def __init__(self, jobs: Sequence[Any], trace: Callable[[Any], tuple[Any, dict]]) -> None:
        import sys

        self._dir = Path(tempfile.mkdtemp(prefix="dflash-templates-"))
        ctx = multiprocessing.get_context("fork")
        self._conn, child_end = ctx.Pipe(duplex=False)
        self._proc = ctx.Process(target=_child, args=(child_end, jobs, trace, self._dir, os.getpid()), daemon=True)
        for stream in (sys.stdout, sys.stderr):  # nothing buffered here may be written twice by the child
            stream.flush()
        self._proc.start()
        child_end.close()  # so a dead child reads as EOF here
        self._seconds: dict[int, float | None] = {}  # job -> its trace's seconds (None: the child failed there)
        self._broken = False

    def take(self, i: int, sources: dict, own_trace_s: float = 0.0) -> tuple[Any, dict, float] | None:
        deadline = time.monotonic() + max(WAIT_FLOOR_S, PATIENCE * own_trace_s)
        while i not in self._seconds and not self._broken:
            left = deadline - time.monotonic()
            try:
                if left <= 0 or not self._conn.poll(left):
                    self._broken = True  # stuck: the parent does the rest
                    break
                j, seconds = self._conn.recv()
            except (EOFError, OSError):  # the child is gone: whatever did not come, the parent traces
                self._broken = True
                break
            self._seconds[j] = seconds
            self._broken = seconds is None
        seconds = self._seconds.get(i)
        if seconds is None:
            return None
        try:
            model, by_graph_name = unpack((self._dir / f"{i}.template").read_bytes(), sources)
        except (OSError, KeyError):  # unreadable, or a weight this process does not have
            return None
        return model, by_graph_name, seconds

    def close(self) -> None:
        if self._proc.is_alive():
            self._proc.terminate()
        self._proc.join(5)
        self._conn.close()
        shutil.rmtree(self._dir, ignore_errors=True)


def _child(conn, jobs, trace, where: Path, parent: int) -> None:
    import signal

    # Ctrl-C reaches the whole process group: the parent handles it and ends this child (close()),
    # which would otherwise print a traceback of its own.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _die_with(parent)
    import torch

    torch.set_num_threads(1)  # the parent uses the other core
    try:
        for i, job in enumerate(jobs):
            t0 = time.perf_counter()
            try:
                model, by_graph_name = trace(job)
                (where / f"{i}.template").write_bytes(pack(model, by_graph_name))
            except Exception:  # noqa: BLE001 - the parent traces this one itself and sees the error there
                conn.send((i, None))
                return
            conn.send((i, time.perf_counter() - t0))
    except OSError:
        return  # the parent is gone or gave up on us
    finally:
        conn.close()


def _die_with(parent: int) -> None:
    """A killed build takes this child with it (Linux), so nothing it inherited, such as the cache
    lock, outlives the build by a trace or a hang."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, 9)  # PR_SET_PDEATHSIG, SIGKILL
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # the parent died before the request took effect
        os._exit(0)
