"""ONNX Runtime's process-wide intra-op thread pool: whether this process shares one among sessions.

Target and draft take turns on the same (spinning) threads instead of two pools fighting for two
cores (demo pair, 16 prompts, alternating processes: plain 1.7-1.9x, DFlash 1.2-1.4x faster than
with a pool per session; benchmarks/results/ort-runtime/demo-thread-pool-decode.txt). Once on, every
session in the process must use it, so the switch is process-wide and made before the engine's
sessions open. A base module: the export's validation and the runtime both open sessions.
"""

from __future__ import annotations

SHARED_POOL_ALLOWED = True  # a process that opens ONNX Runtime sessions of its own (the tests) turns this off
_shared_pool = False


def use_shared_thread_pool(threads: int = 0) -> bool:
    """Turn ONNX Runtime's global intra-op pool on for this process (`threads`: 0 = one per core).
    Returns whether every session opened from now on shares it."""
    global _shared_pool
    if _shared_pool or not SHARED_POOL_ALLOWED:
        return _shared_pool
    from onnxruntime.capi import _pybind_state

    try:
        _pybind_state.set_global_thread_pool_sizes(threads, 1)
    except Exception:  # created already by other code in this process: keep per-session pools
        return False
    _shared_pool = True
    return True


def shared_thread_pool() -> bool:
    return _shared_pool


def apply_thread_pool(opts) -> None:
    """Sessions must use the global pool once it exists (ONNX Runtime refuses per-session ones then)."""
    if _shared_pool:
        opts.use_per_session_threads = False
