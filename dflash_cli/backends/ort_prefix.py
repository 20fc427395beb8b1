"""ONNX Runtime session over a prefix-cache graph: the host owns the KV cache and hands over only what is filled.

The prefix-cache graphs (`*_prefix.onnx`, StaticCacheTarget.use_prefix_cache) take `past_*` as
[1, L, kv_heads, head_dim] with L the slots filled before the call, and return the call's own K/V as
`present_*` [1, s, kv_heads, head_dim]. This session keeps one slot-major buffer per cache input,
[1, ctx_len, kv_heads, head_dim]: a call binds the prefix buffer[:, :L] in place (contiguous, so no
copy), and afterwards writes each real row's present K/V at its position (padding rows, position -1,
are dropped). So a call reads the L filled slots, not ctx_len, and nothing copies the cache; the
static graph's ScatterElements copied every layer's whole cache on every call.

L is the call's first position (`position_ids[0, 0]` for the target, `context_position_ids[0, 0]`
for the draft): calls are contiguous from position 0, a rejected block is overwritten by the next
call starting at the first uncommitted position, and slots at or beyond L are never read.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from dflash_cli.backends.base import (
    SessionTraits,
    drafts_any_rows,
    is_cache_input,
    is_kv_input,
    with_proposal_rows,
)
from dflash_cli.backends.carried_state import CarriedState
from dflash_cli.backends.ort import OrtSettings, cpu_session
from dflash_cli.backends.ort_kv_inplace import OrtInPlaceKvSession, is_in_place_graph
from dflash_cli.backends.single_row import first_row, pad_single_row
from dflash_cli.errors import BackendError
from dflash_cli.vision.feeds import VisionFeeder

PRESENT_PREFIX = "present_"


def is_prefix_graph(onnx_path: Path) -> bool:
    import onnx

    model = onnx.load(str(onnx_path), load_external_data=False)
    return any(o.name.startswith(PRESENT_PREFIX) for o in model.graph.output)


def open_prefix_session(onnx_path: Path, name: str, ctx_len: int, settings=None, initializers=None):
    """The session a compiled prefix-cache graph needs: in-place KV buffers where the compile stage rewrote
    its attention (ortcompile/gqa.py), else host-stored K/V (this module)."""
    cls = OrtInPlaceKvSession if is_in_place_graph(onnx_path) else OrtPrefixSession
    return cls(onnx_path, name, ctx_len, settings, initializers)


class OrtPrefixSession(SessionTraits):
    variable_length = True  # calls of any number of tokens: nothing is padded to a fixed shape
    pad_single_rows = True  # ... but a one-token target call as two rows (single_row.py; the engine decides)

    def __init__(
        self,
        onnx_path: Path,
        name: str,
        ctx_len: int,
        settings: OrtSettings | None = None,
        initializers: dict | None = None,
    ) -> None:
        self.provider, self._sess = cpu_session(onnx_path, name, "prefix-cache", settings, initializers)
        self.name, self.ctx_len = name, ctx_len
        inputs = self._sess.get_inputs()
        self.cache_names = [i.name for i in inputs if is_kv_input(i.name)]
        self.input_names = [i.name for i in inputs if not is_cache_input(i.name)]
        self.any_block_rows = drafts_any_rows(inputs)  # a draft that drafts as many rows as it is handed
        self._carried = CarriedState(inputs, PRESENT_PREFIX)  # a hybrid target's linear-attention states
        outputs = [o.name for o in self._sess.get_outputs()]
        self.output_names = [o for o in outputs if not o.startswith(PRESENT_PREFIX)]
        self._present = {n: PRESENT_PREFIX + n.removeprefix("past_") for n in self.cache_names}
        missing = [p for p in [*self._present.values(), *self._carried.present.values()] if p not in outputs]
        if missing:
            raise BackendError(f"{name}: not a prefix-cache graph (no outputs {missing[:2]})")
        dtype = {"tensor(float)": np.float32, "tensor(float16)": np.float16}
        self._buffers = {
            i.name: np.zeros((1, ctx_len, i.shape[2], i.shape[3]), dtype[i.type]) for i in inputs if is_kv_input(i.name)
        }
        self._positions_input = "context_position_ids" if "context_position_ids" in self.input_names else "position_ids"
        self._binding = self._sess.io_binding()
        self.vision = VisionFeeder(inputs)

    @property
    def inference_session(self):
        """The ONNX Runtime session underneath: batched sessions (backends/ort_batched.py) take it over for
        calls of one sequence, and read its input shapes."""
        return self._sess

    def reset(self, fill: float = 0.0) -> None:
        """Nothing to clear (slots at or beyond a call's first position are never read); `fill` is honoured
        for callers that want the buffers in a known state."""
        for buf in self._buffers.values():
            buf.fill(fill)
        self._carried.reset(fill)

    def run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        if self.pad_single_rows and self._positions_input == "position_ids":  # the target (see single_row.py)
            feeds, padded = pad_single_row(feeds, self.ctx_len)
            if padded:
                return first_row(self._run(feeds))
        return self._run(feeds)

    def _run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        feeds = self.vision.complete(feeds)  # after single-row padding: the padding row's values too
        feeds = with_proposal_rows(feeds, self.input_names)
        positions = np.asarray(feeds[self._positions_input])
        start = int(positions[0, 0])
        if start < 0 or start + positions.shape[1] > self.ctx_len:
            raise BackendError(
                f"{self.name}: a call at positions {start}..{start + positions.shape[1] - 1} does not fit "
                f"the cache ({self.ctx_len} slots)"
            )
        b = self._binding
        b.clear_binding_inputs()
        b.clear_binding_outputs()
        for n, arr in feeds.items():
            b.bind_cpu_input(n, np.ascontiguousarray(arr))
        for n, buf in self._buffers.items():
            view = buf[:, :start]  # contiguous: the buffer is slot-major with batch 1
            b.bind_input(n, "cpu", 0, buf.dtype.type, list(view.shape), view.ctypes.data)
        self._carried.bind(b)
        outs = list(self.output_names) + list(self._present.values()) + list(self._carried.present.values())
        for n in outs:
            b.bind_output(n, "cpu")
        self._sess.run_with_iobinding(b)
        values = dict(zip(outs, (v.numpy() for v in b.get_outputs())))
        self._carried.update(values)
        real = positions[0] >= 0
        slots = positions[0][real]
        for n, buf in self._buffers.items():
            buf[0, slots] = values[self._present[n]][0, real]
        return {n: values[n] for n in self.output_names}
