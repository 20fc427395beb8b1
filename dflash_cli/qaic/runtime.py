"""A backends.base.Session over the Cloud AI 100 Python runtime `qaicrt`.

NOT RUN ON A CARD. This module follows the SDK's documented Python API as QEfficient uses it
(Context, Queue, Qpc, Program, ExecObj, QBuffer, BufferDimensionsVecRef, IO descriptor from
QAicApi_pb2) and is unit-tested only against a fake `qaicrt`. What a card must confirm is
marked "unverified" below.

Retained state: the program was compiled with -retained-state, so every `past_*` input is
tied on the device to the matching `*_RetainedState` output. Passing a zero-size buffer for
both tells the runtime to keep the device copy and skip the host transfer; the host never
sees the cache and never feeds it, not even zeros at the start of a sequence (QEfficient never
does either; with an mxint8 cache a host zero buffer would not even have the device's size). A
fresh or reused buffer may hold anything: the graph ignores cache slots no query can see (masked
scores, and V zeroed there), so stale or uninitialised slots never reach an output.

Padding: positions of -1 are mapped to the spare cache slot (ctx_len - 1) by the graph itself
(see the export contract), because the device's handling of a negative scatter index is not
guaranteed. This session passes positions through unchanged.
"""

from __future__ import annotations

import platform
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np

from dflash_cli.backends.base import SessionTraits, is_cache_input
from dflash_cli.errors import BackendError
from dflash_cli.qaic.sdk import sdk_root
from dflash_cli.qaic.specs import PROGRAM_FILE, QPC_DIR

DEFAULT_TIMEOUT_MS = 60_000
RESET_MODES = ("keep", "reactivate")
# SDK 1.22 renamed the program's timeout property; set whichever this runtime has.
TIMEOUT_PROPERTIES = ("dataPathTimeoutMs", "SubmitRetryTimeoutMs")


def import_runtime() -> tuple[ModuleType, ModuleType]:
    """(qaicrt, QAicApi_pb2), adding the SDK's library dirs to sys.path only when needed."""
    root = sdk_root()
    for path in (root / "dev" / "lib" / platform.machine(), root / "dev" / "python"):
        if path.is_dir() and str(path) not in sys.path:
            sys.path.append(str(path))
    try:
        import QAicApi_pb2
        import qaicrt
    except ImportError as exc:
        raise BackendError(
            f"the QAIC Python runtime (qaicrt, QAicApi_pb2) is not importable from {root}/dev: {exc}",
            hint="install the Cloud AI 100 Platform and Apps SDKs on this host, or use the ort backend",
        ) from exc
    return qaicrt, QAicApi_pb2


def _dtype_table(aicapi: ModuleType) -> dict[int, np.dtype]:
    """IO-descriptor element types -> numpy dtypes (names from QAicApi_pb2; absent ones skipped)."""
    names = {
        "FLOAT_TYPE": np.float32,
        "FLOAT_16_TYPE": np.float16,
        "INT64_I_TYPE": np.int64,
        "INT32_I_TYPE": np.int32,
        "INT32_Q_TYPE": np.int32,
        "INT16_Q_TYPE": np.int16,
        "INT8_Q_TYPE": np.int8,
        "UINT8_Q_TYPE": np.uint8,
        "INT8_TYPE": np.int8,
    }
    return {getattr(aicapi, n): np.dtype(t) for n, t in names.items() if hasattr(aicapi, n)}


def _is_state(name: str) -> bool:
    return is_cache_input(name) or name.endswith("_RetainedState")


class QaicSession(SessionTraits):
    """One compiled graph (target or draft) on one or more cards."""

    variable_length = False  # only the lengths of the program's specializations: the loops pad to them
    compiled_slots = True  # compile.qaic.full_batch_size: the program holds the caches of its sequences
    host_checked = False  # compiled without a card: the build ran none of its checks on it

    def __init__(
        self,
        qpc_dir: Path,
        name: str,
        device_ids: Sequence[int] = (0,),
        *,
        timeout_ms: int = DEFAULT_TIMEOUT_MS,
        reset_mode: str = "keep",
        runtime: tuple[ModuleType, ModuleType] | None = None,
        num_cores: int | None = None,  # for error messages: what this program asks of its cards
    ) -> None:
        if reset_mode not in RESET_MODES:
            raise ValueError(f"reset_mode must be one of {RESET_MODES}, not {reset_mode!r}")
        self.name = name
        self.reset_mode = reset_mode
        self._rt, aicapi = runtime or import_runtime()
        rt = self._rt
        self._ok = rt.QStatus.QS_SUCCESS
        self._dtypes = _dtype_table(aicapi)
        ids = list(device_ids)
        self._context = rt.Context(rt.QIDList(ids)) if len(ids) > 1 else rt.Context()
        self._queue = rt.Queue(self._context, ids[0])

        qpc = rt.Qpc(str(qpc_dir))
        status, raw = qpc.getIoDescriptor()
        self._check(status, "reading the IO descriptor")
        iodesc = aicapi.IoDesc()
        iodesc.ParseFromString(bytes(raw))
        # Buffers are passed as a list indexed by binding.index; keep bindings in that order.
        self._bindings = sorted(iodesc.selected_set.bindings, key=lambda b: b.index)
        if [b.index for b in self._bindings] != list(range(len(self._bindings))):
            raise BackendError(f"unexpected binding indices in the {name} program's IO descriptor")
        # One shape set per specialization: the dims of every binding, in binding order.
        self._shape_sets = [[list(s.dims) for s in allowed.shapes] for allowed in iodesc.allowed_shapes]
        is_input = {b.name: b.dir == aicapi.BUFFER_IO_TYPE_INPUT for b in self._bindings}
        self.input_names = [b.name for b in self._bindings if is_input[b.name] and not _is_state(b.name)]
        self.output_names = [b.name for b in self._bindings if not is_input[b.name] and not _is_state(b.name)]
        self._is_input = is_input

        props = rt.QAicProgramProperties()
        self.timeout_property = next((p for p in TIMEOUT_PROPERTIES if hasattr(props, p)), None)
        if self.timeout_property is not None:
            setattr(props, self.timeout_property, timeout_ms)
        if len(ids) > 1:
            props.devMapping = ":".join(str(i) for i in ids)
        self._program = rt.Program(self._context, ids[0] if len(ids) == 1 else None, qpc, props)
        self._check(self._program.load(), "loading the program")
        self._where = f"device{'s' if len(ids) > 1 else ''} {', '.join(map(str, ids))}"
        self._where += f", {num_cores} cores" if num_cores else ""
        self._activate()
        self._exec = rt.ExecObj(self._context, self._program)

    def _activate(self) -> None:
        status = self._program.activate()
        if status is not None:  # bindings that return nothing from activate() report failures by raising
            self._check(
                status,
                f"activating the program on {self._where} (another program may hold the cores: "
                "`qaic-util -q` shows each card's free NSPs)",
            )

    def _check(self, status: Any, what: str) -> None:
        if status != self._ok:
            raise BackendError(f"QAIC runtime failed {what} for the {self.name} graph (status {status})")

    def reset(self) -> None:
        """Start a new sequence. "keep" (default): nothing to do, no transfer.

        A new sequence writes cache slots from position 0 and each query sees only slots at or
        before its own position; slots no query sees are zeroed in V inside the graph, so what a
        previous sequence (or uninitialised memory) left there, NaN included, cannot leak through
        0 x NaN. "reactivate" (UNVERIFIED on a card): deactivate and re-activate the program, for
        hosts that want fresh buffers anyway; slower to switch.
        """
        if self.reset_mode == "reactivate":
            del self._exec
            self._program.deactivate()
            self._activate()
            self._exec = self._rt.ExecObj(self._context, self._program)

    def run(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        if "batch_index" in self.input_names and "batch_index" not in feeds:
            # a program whose cache holds several sequences (qaic/slots.py), run as a one-sequence session: slot 0
            feeds = {**feeds, "batch_index": np.zeros((np.shape(feeds["input_ids"])[0], 1), np.int64)}
        missing = [n for n in self.input_names if n not in feeds]
        if missing:
            raise ValueError(f"{self.name}: missing inputs {missing}")
        shapes = self._output_shapes(feeds)
        buffers, dims = [], []
        for b in self._bindings:
            dtype = self._dtypes[b.type]
            if _is_state(b.name):
                # Zero-size buffer: keep the device copy, skip the transfer (as QEfficient does).
                array = np.array([])
            elif self._is_input[b.name]:
                array = np.ascontiguousarray(feeds[b.name], dtype=dtype)
            else:
                array = np.zeros(shapes[b.index], dtype=dtype)  # sized for this specialization
            buffers.append(self._rt.QBuffer(array.tobytes()))
            dims.append((array.itemsize, list(array.shape) if array.ndim else [1]))
        self._check(self._exec.setData(buffers, self._rt.BufferDimensionsVecRef(dims)), "setting buffers")
        self._check(self._queue.enqueue(self._exec), "enqueueing")
        self._check(self._exec.waitForCompletion(), "running (shape not among the specializations?)")
        status, out = self._exec.getData()
        self._check(status, "reading outputs")
        result: dict[str, np.ndarray] = {}
        for b in self._bindings:
            if b.name not in self.output_names:
                continue
            array = np.frombuffer(bytes(out[b.index]), dtype=self._dtypes[b.type]).reshape(shapes[b.index])
            # mxfp6/mxint8 builds may hand float outputs back as float16; callers get float32.
            if np.issubdtype(array.dtype, np.floating) and array.dtype != np.float32:
                array = array.astype(np.float32)
            result[b.name] = array
        return result

    def serves(self, shapes: Mapping[str, Sequence[int]]) -> bool:
        """Whether a compiled specialization takes inputs of these shapes (name -> dims; names left out match)."""
        if not self._shape_sets:
            return all(list(dims) == list(b.dims) for b in self._bindings if (dims := shapes.get(b.name)) is not None)
        return any(
            all(list(shapes[b.name]) == s[b.index] for b in self._bindings if b.name in shapes)
            for s in self._shape_sets
        )

    def _output_shapes(self, feeds: Mapping[str, np.ndarray]) -> dict[int, list[int]]:
        """Binding index -> dims of the specialization whose input shapes match `feeds`."""
        if not self._shape_sets:
            return {b.index: list(b.dims) for b in self._bindings}
        for shape_set in self._shape_sets:
            if all(
                list(np.shape(feeds[b.name])) == shape_set[b.index]
                for b in self._bindings
                if b.name in self.input_names
            ):
                return {b.index: shape_set[b.index] for b in self._bindings}
        fed = {n: list(np.shape(feeds[n])) for n in self.input_names}
        allowed = [{b.name: s[b.index] for b in self._bindings if b.name in self.input_names} for s in self._shape_sets]
        raise ValueError(f"{self.name}: input shapes {fed} match no compiled specialization {allowed}")

    def close(self) -> None:
        """Release the device program (a later run() on this object is an error)."""
        del self._exec
        self._program.deactivate()


def open_qaic_session(
    compile_dir: Path,
    graph_name: str,
    device_id: int | Sequence[int] = 0,
    **kwargs: Any,
) -> QaicSession:
    """Open `<compile_dir>/<graph_name>/qpc` on card `device_id` (or several, for an MDP build)."""
    qpc_dir = Path(compile_dir) / graph_name / QPC_DIR
    if not (qpc_dir / PROGRAM_FILE).is_file():
        raise BackendError(
            f"no compiled QAIC program at {qpc_dir / PROGRAM_FILE}",
            hint="run `dflash compile --backend qaic` first (or compile.sh from an emitted bundle)",
        )
    ids = [device_id] if isinstance(device_id, int) else list(device_id)
    return QaicSession(qpc_dir, graph_name, ids, **kwargs)
