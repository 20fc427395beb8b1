"""ONNX Runtime sessions that run several sequences per call, each sequence in a cache slot of its own.

Continuous batching (decoding/batching.py) hands these a list of (slot, feeds) every step. A decode step
is bound by reading the weights, so one call over every sequence's rows costs little more than one
sequence's call. Both classes give each sequence exactly what its one-sequence session would: the
compile stage checks it (`batch_invariance` in compile.json).

* BatchedTarget: the in-place-cache target (ortcompile/gqa.py). A call of n sequences runs a copy of
  the graph split per sequence (ortcompile/per_sequence.py), opened on first use for each n; each
  sequence's attention reads and writes its own slot's buffers in place, so nothing is copied.
* BatchedDraft: the draft's prefix-cache graph, batched along axis 0. Sequences have filled different
  lengths, so the call hands each its slot's cache up to the longest (a copy, small: the draft has a
  few layers) and the graph masks what a sequence has not filled (StaticCacheDraft._prefix_visible).
"""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np

from dflash_cli.backends.base import is_kv_input, proposal_rows, with_proposal_rows
from dflash_cli.backends.ort import OrtSettings, session_options
from dflash_cli.backends.single_row import first_row, pad_single_row
from dflash_cli.errors import BackendError
from dflash_cli.exporting.names import PROPOSAL_ROWS

_DTYPES = {"tensor(float)": np.float32, "tensor(float16)": np.float16}
# A session's weights as ONNX Runtime packs them, over the graph's weight bytes (1.26 measured on the 4B int4 target)
PACKED_WEIGHTS = 1.25


def _open(path: Path, settings: OrtSettings | None, initializers: dict | None, model=None):
    """A CPU session over `path`, or over `model` (a ModelProto whose external data sits beside `path`)."""
    import onnxruntime as ort

    opts = session_options(settings or OrtSettings(), initializers)
    if model is None:
        return ort.InferenceSession(str(path), sess_options=opts, providers=["CPUExecutionProvider"])
    opts.add_session_config_entry("session.model_external_initializers_file_folder_path", str(path.parent))
    return ort.InferenceSession(model.SerializeToString(), sess_options=opts, providers=["CPUExecutionProvider"])


def _pad_rows(feeds: list[dict[str, np.ndarray]], names: list[str], width: int) -> dict[str, np.ndarray]:
    """Stack each sequence's [1, w, ...] inputs into [n, width, ...]; positions pad with -1, the rest with 0."""
    out = {}
    for name in names:
        first = np.asarray(feeds[0][name])
        fill = -1 if name.endswith("position_ids") else 0
        arr = np.full((len(feeds), width, *first.shape[2:]), fill, dtype=first.dtype)
        for j, f in enumerate(feeds):
            a = np.asarray(f[name])
            arr[j, : a.shape[1]] = a[0]
        out[name] = arr
    return out


class BatchedTarget:
    name = "target"
    variable_length = True

    def __init__(
        self,
        onnx_path: Path,
        ctx_len: int,
        slots: int,
        settings=None,
        initializers=None,
        pad_single_rows: bool = True,
        one=None,
    ) -> None:
        """`one`: an open session of this graph, for calls of one sequence (else opened here)."""
        import onnx

        from dflash_cli.ortcompile.gqa import SPARE_SLOTS

        self.path, self.ctx_len, self.pad_single_rows, self.slots = Path(onnx_path), ctx_len, pad_single_rows, slots
        self._settings, self._initializers = settings, initializers
        self._model = onnx.load(str(onnx_path), load_external_data=False)
        self._sessions: dict[int, object] = {1: one} if one is not None else {}
        self._lock = threading.Lock()  # sessions open on first use, from whichever thread dispatches
        one = self.session(1)
        inputs = one.get_inputs()
        self.cache_names = [i.name for i in inputs if is_kv_input(i.name)]
        self.input_names = [i.name for i in inputs if not i.name.startswith("past_")]
        self.output_names = [o.name for o in one.get_outputs() if not o.name.startswith("present_")]
        spec = {i.name: (i.shape[1], i.shape[3], _DTYPES[i.type]) for i in inputs if is_kv_input(i.name)}
        self.slots_per_cache = ctx_len + SPARE_SLOTS
        self._buffers = [
            {n: np.zeros((1, h, self.slots_per_cache, d), t) for n, (h, d, t) in spec.items()} for _ in range(slots)
        ]

    def session(self, n: int):
        with self._lock:
            if n not in self._sessions:
                from dflash_cli.ortcompile.per_sequence import split_sequences

                model = None if n == 1 else split_sequences(self._model, n)
                self._sessions[n] = _open(self.path, self._settings, self._initializers, model)
            return self._sessions[n]

    def run(self, slots: list[int], feeds: list[dict[str, np.ndarray]]) -> list[dict[str, np.ndarray]]:
        """One call for every (slot, feeds) whose rows fit beside the others'; each sequence's outputs [1, w, ...]."""
        widths = [np.asarray(f["input_ids"]).shape[1] for f in feeds]
        width = max(2, *widths)  # each sequence's attention takes at least two rows (ortcompile/gqa.py)
        starts = [self._start(f, w) for f, w in zip(feeds, widths)]
        fits = [s + width <= self.slots_per_cache for s in starts]
        if len(feeds) > 1 and not all(fits):  # near the end of its cache a sequence cannot take the padding
            out: list = [None] * len(feeds)
            ok = [j for j, f in enumerate(fits) if f]
            for j in [j for j, f in enumerate(fits) if not f]:
                out[j] = self.run([slots[j]], [feeds[j]])[0]
            if ok:
                for j, r in zip(ok, self.run([slots[j] for j in ok], [feeds[j] for j in ok])):
                    out[j] = r
            return out
        if len(feeds) == 1:
            one, padded = pad_single_row(feeds[0], self.ctx_len) if self.pad_single_rows else (feeds[0], False)
            res = self._call([slots[0]], [one], np.asarray(one["input_ids"]).shape[1])[0]
            return [first_row(res) if padded else res]
        return self._call(slots, feeds, max(widths))

    def _start(self, feeds, width: int) -> int:
        pos = np.asarray(feeds["position_ids"])[0]
        start = int(pos[0])
        real = int(np.count_nonzero(pos >= 0))
        if start < 0 or start + width > self.ctx_len or not np.array_equal(pos[:real], np.arange(start, start + real)):
            raise BackendError(
                f"target: a call at positions {pos.tolist()[:6]}... is not contiguous or does not fit the cache "
                f"({self.ctx_len} slots)",
                hint="a dflash bug in the decoding loop",
            )
        return start

    def _call(self, slots, feeds, width):
        sess = self.session(len(slots))
        b = sess.io_binding()
        for name, arr in _pad_rows(feeds, self.input_names, width).items():
            b.bind_cpu_input(name, arr)
        from dflash_cli.ortcompile.per_sequence import seq_name

        for j, slot in enumerate(slots):
            for name, arr in self._buffers[slot].items():
                bound = name if len(slots) == 1 else seq_name(name, j)
                present = "present_" + bound.removeprefix("past_")
                b.bind_input(bound, "cpu", 0, arr.dtype.type, list(arr.shape), arr.ctypes.data)
                b.bind_output(present, "cpu", 0, arr.dtype.type, list(arr.shape), arr.ctypes.data)
        for name in self.output_names:
            b.bind_output(name, "cpu")
        sess.run_with_iobinding(b)
        values = b.get_outputs()
        first = len(values) - len(self.output_names)  # the cache outputs were bound first
        outs = {name: values[first + k].numpy() for k, name in enumerate(self.output_names)}
        widths = [np.asarray(f["input_ids"]).shape[1] for f in feeds]
        # copies: the arrays are views of ONNX Runtime's output buffers, which live only as long as the binding
        return [{n: v[j : j + 1, : widths[j]].copy() for n, v in outs.items()} for j in range(len(slots))]


class BatchedDraft:
    name = "draft"
    variable_length = True

    def __init__(
        self, onnx_path: Path, ctx_len: int, slots: int, settings=None, initializers=None, session=None
    ) -> None:
        """`session`: an open session of this graph (else opened here)."""
        self.ctx_len = ctx_len
        self._sess = session if session is not None else _open(Path(onnx_path), settings, initializers)
        inputs = self._sess.get_inputs()
        if inputs[0].shape[0] != "batch":
            raise BackendError("the draft's prefix graph takes one sequence per call", hint="rebuild the pair")
        self.cache_names = [i.name for i in inputs if is_kv_input(i.name)]
        self.input_names = [i.name for i in inputs if not i.name.startswith("past_")]
        outputs = [o.name for o in self._sess.get_outputs()]
        self.output_names = [o for o in outputs if not o.startswith("present_")]
        self._present = {n: "present_" + n.removeprefix("past_") for n in self.cache_names}
        spec = {i.name: (i.shape[2], i.shape[3], _DTYPES[i.type]) for i in inputs if is_kv_input(i.name)}
        self._buffers = [{n: np.zeros((1, ctx_len, h, d), t) for n, (h, d, t) in spec.items()} for _ in range(slots)]

    def run(self, slots: list[int], feeds: list[dict[str, np.ndarray]]) -> list[dict[str, np.ndarray]]:
        ctx_pos = [np.asarray(f["context_position_ids"])[0] for f in feeds]
        starts = [int(p[0]) for p in ctx_pos]
        width = max(p.shape[0] for p in ctx_pos)
        for s, p in zip(starts, ctx_pos):
            if s < 0 or s + p.shape[0] > self.ctx_len:
                raise BackendError(
                    f"draft: a call at context positions {s}.. does not fit the cache ({self.ctx_len} slots)"
                )
        filled = max(starts)
        b = self._sess.io_binding()
        stacked = _pad_rows(feeds, ["context_features", "context_position_ids"], width)
        stacked |= {n: np.concatenate([np.asarray(f[n]) for f in feeds]) for n in ("input_ids", "position_ids")}
        if PROPOSAL_ROWS in self.input_names:  # as many proposals as the sequence that wants the most
            wanted = [with_proposal_rows(f, self.input_names)[PROPOSAL_ROWS].shape[1] for f in feeds]
            stacked[PROPOSAL_ROWS] = proposal_rows(max(wanted), len(feeds))
        for name, arr in stacked.items():
            b.bind_cpu_input(name, np.ascontiguousarray(arr))
        for name in self.cache_names:
            if len(slots) == 1:  # its own prefix, in place (slot-major: contiguous)
                past = self._buffers[slots[0]][name][:, :filled]
                b.bind_input(name, "cpu", 0, past.dtype.type, list(past.shape), past.ctypes.data)
            else:
                b.bind_cpu_input(name, np.concatenate([self._buffers[s][name][:, :filled] for s in slots]))
        outs = self.output_names + list(self._present.values())
        for name in outs:
            b.bind_output(name, "cpu")
        self._sess.run_with_iobinding(b)
        values = dict(zip(outs, (v.numpy() for v in b.get_outputs())))
        for j, (slot, p) in enumerate(zip(slots, ctx_pos)):
            real = p >= 0
            for name, buf in self._buffers[slot].items():
                buf[0, p[real]] = values[self._present[name]][j, : p.shape[0]][real]
        return [{n: values[n][j : j + 1].copy() for n in self.output_names} for j in range(len(slots))]
