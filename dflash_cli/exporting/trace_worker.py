"""Trace the later graphs of an export in a forked process while this one writes the first's weights.

An export traces four one-layer graphs (target and draft, each static and prefix-cache), each one to
a few seconds of single-threaded Python, and streams gigabytes of weights. With a second core, a
forked child traces the later three while the parent traces the target's static graph and writes its
weights, most of the bytes (exporting/graphs.py picks the split); the child sends
each optimised template back without weight bytes (its weight initializers become placeholders and
the parent points them at the checkpoint again). Whatever happens to the child (an exception, a kill,
a hang) the parent traces what it did not get itself, so the graphs never depend on it.
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
from collections.abc import Callable, Sequence
from typing import Any

from dflash_cli.exporting.torch_to_onnx import WRAPPER_PREFIX, lazy_weight

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
    """A forked child running `trace(job)` for each of `jobs` in order; `take(i)` returns job i's
    (model, by_graph_name, seconds), or None when the child could not deliver it. With `setup`
    instead, the child calls it first for (jobs, trace): the early tracer forks before the parent
    has imported torch, and the child builds its own jobs (early_trace.py)."""

    def __init__(
        self,
        jobs: Sequence[Any] = (),
        trace: Callable[[Any], tuple[Any, dict]] | None = None,
        *,
        setup: Callable[[], tuple[Sequence[Any], Callable[[Any], tuple[Any, dict]]]] | None = None,
        quiet: bool = False,
    ) -> None:
        import sys
        import threading

        if setup is None:
            setup = lambda: (jobs, trace)  # noqa: E731 - the child's view of the jobs given here
        ctx = multiprocessing.get_context("fork")
        self._conn, child_end = ctx.Pipe(duplex=False)
        self._proc = ctx.Process(target=_child, args=(child_end, setup, os.getpid(), quiet), daemon=True)
        for stream in (sys.stdout, sys.stderr):  # nothing buffered here may be written twice by the child
            stream.flush()
        self._proc.start()
        child_end.close()  # so a dead child reads as EOF here
        self._got: dict[int, tuple[bytes | None, float]] = {}
        self._broken = False
        self._arrived = threading.Condition()
        # Templates are received as they come, so the child never waits on a full pipe for the parent
        # to ask (it would stall until the parent had written the first graph's weights).
        threading.Thread(target=self._receive, name="dflash-trace-receiver", daemon=True).start()

    def _receive(self) -> None:
        while True:
            try:
                j, blob, seconds = self._conn.recv()
            except (EOFError, OSError):
                blob = None  # the child is gone (or closed): whatever did not come, the parent traces
                j, seconds = None, 0.0
            with self._arrived:
                if j is not None:
                    self._got[j] = (blob, seconds)
                if blob is None:
                    self._broken = True
                self._arrived.notify_all()
            if blob is None:
                return

    def take(self, i: int, sources: dict, own_trace_s: float) -> tuple[Any, dict, float] | None:
        with self._arrived:
            arrived = self._arrived.wait_for(
                lambda: i in self._got or self._broken, timeout=max(WAIT_FLOOR_S, PATIENCE * own_trace_s)
            )
            if not arrived:
                self._broken = True  # stuck: the parent does the rest
            blob, seconds = self._got.pop(i, (None, 0.0))
        if blob is None:
            return None
        try:
            model, by_graph_name = unpack(blob, sources)
        except KeyError:  # a weight this process does not have: not the graph it wants
            return None
        return model, by_graph_name, seconds

    def close(self) -> None:
        if self._proc.is_alive():
            self._proc.terminate()
        self._proc.join(5)
        self._conn.close()


def _child(conn, setup, parent: int, quiet: bool) -> None:
    import signal
    import time

    # Ctrl-C reaches the whole process group: the parent handles it and ends this child (close()),
    # which would otherwise print a traceback of its own.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _die_with(parent)
    if quiet and os.environ.get("DFLASH_DEBUG") != "1":
        _silence()  # whatever goes wrong here, the parent traces the graph itself and reports that
    import torch

    torch.set_num_threads(1)  # the parent uses the other core
    try:
        try:
            jobs, trace = setup()
        except Exception:  # noqa: BLE001 - the parent traces everything itself
            conn.send((0, None, 0.0))
            return
        for i, job in enumerate(jobs):
            t0 = time.perf_counter()
            try:
                model, by_graph_name = trace(job)
                blob = pack(model, by_graph_name)
            except Exception:  # noqa: BLE001 - the parent traces this one itself and sees the error there
                conn.send((i, None, 0.0))
                return
            conn.send((i, blob, time.perf_counter() - t0))
    except (BrokenPipeError, OSError):
        return  # the parent is gone or gave up on us
    finally:
        conn.close()


def _silence() -> None:
    devnull = os.open(os.devnull, os.O_WRONLY)
    for fd in (1, 2):
        os.dup2(devnull, fd)
    os.close(devnull)


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
