"""ONNX Runtime session over a graph whose attention updates the KV cache in place (ortcompile/gqa.py).

Each layer's `past_key.i` and `present_key.i` are bound to the same buffer, [1, kv_heads, ctx_len,
head_dim], allocated once: GroupQueryAttention writes the call's K/V at slots start.. and attends over
the slots before them, so a call moves nothing but its own rows and costs in proportion to the
filled length. A rejected block needs no rollback: the next call starts at the first uncommitted
position and overwrites it, and no query ever reads a slot at or beyond its own position.

The graph takes the call's start from position_ids[0, 0] and numbers the rows from there, so a call
must be contiguous (real rows at start, start+1, ..., padding after them); `run` checks it.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from dflash_cli.backends.base import SessionTraits, drafts_any_rows, is_cache_input, is_kv_input
from dflash_cli.backends.carried_state import CarriedState
from dflash_cli.backends.ort import OrtSettings, cpu_session
from dflash_cli.backends.single_row import first_row, pad_single_row
from dflash_cli.errors import BackendError
from dflash_cli.vision.feeds import VisionFeeder


def is_in_place_graph(onnx_path: Path) -> bool:
    import onnx

    from dflash_cli.ortcompile.gqa import KV_IN_PLACE, KV_LAYOUT_KEY

    model = onnx.load(str(onnx_path), load_external_data=False)
    return any(p.key == KV_LAYOUT_KEY and p.value == KV_IN_PLACE for p in model.metadata_props)


class OrtInPlaceKvSession(SessionTraits):
    variable_length = True  # calls of any number of tokens
    pad_single_rows = True  # a one-token call as two rows (single_row.py); the engine sets it from the build

    def __init__(
        self,
        onnx_path: Path,
        name: str,
        ctx_len: int,
        settings: OrtSettings | None = None,
        initializers: dict | None = None,
    ) -> None:
        import onnxruntime as ort

        self.provider, self._sess = cpu_session(onnx_path, name, "in-place-cache", settings, initializers)
        self.name, self.ctx_len = name, ctx_len
        inputs = self._sess.get_inputs()
        self.cache_names = [i.name for i in inputs if is_kv_input(i.name)]
        self.input_names = [i.name for i in inputs if not is_cache_input(i.name)]
        self.any_block_rows = drafts_any_rows(inputs)  # a draft that drafts as many rows as it is handed
        self._carried = CarriedState(inputs)  # a hybrid target's linear-attention states
        present = {n: "present_" + n.removeprefix("past_") for n in self.cache_names}
        outputs = [o.name for o in self._sess.get_outputs()]
        missing = [p for p in [*present.values(), *self._carried.present.values()] if p not in outputs]
        if missing:
            raise BackendError(f"{name}: not an in-place-cache graph (no outputs {missing[:2]})")
        carried_out = set(self._carried.present.values())
        self.output_names = [o for o in outputs if o not in present.values() and o not in carried_out]
        dtype = {"tensor(float)": np.float32, "tensor(float16)": np.float16}
        from dflash_cli.ortcompile.gqa import SPARE_SLOTS

        slots = ctx_len + SPARE_SLOTS  # the graph attends a one-token call as two rows, even at the last slot
        self._arrays = {
            i.name: np.zeros((1, i.shape[1], slots, i.shape[3]), dtype[i.type]) for i in inputs if i.name in present
        }
        self._binding = self._sess.io_binding()
        self.vision = VisionFeeder(inputs)
        self._values = []  # the OrtValues wrap the numpy arrays' memory (CPU, no copy): both stay alive here
        for n, arr in self._arrays.items():
            # One buffer is both the input and the output: ONNX Runtime writes the new rows into it.
            value = ort.OrtValue.ortvalue_from_numpy(arr)
            self._binding.bind_ortvalue_input(n, value)
            self._binding.bind_ortvalue_output(present[n], value)
            self._values.append(value)

    @property
    def inference_session(self):
        """The ONNX Runtime session underneath: batched sessions (backends/ort_batched.py) take it over for
        calls of one sequence, and read its input shapes."""
        return self._sess

    def reset(self, fill: float = 0.0) -> None:
        """Nothing to clear (no query reads a slot at or beyond its position); `fill` is honoured for
        callers that want the buffers in a known state."""
        for arr in self._arrays.values():
            arr.fill(fill)
        self._carried.reset(fill)

    def run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        if self.pad_single_rows:
            feeds, padded = pad_single_row(feeds, self.ctx_len)
            if padded:
                return first_row(self._run(feeds))
        return self._run(feeds)

    def _run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        feeds = self.vision.complete(feeds)  # after single-row padding: the padding row's values too
        positions = np.asarray(feeds["position_ids"])
        n = positions.shape[1]
        start = int(positions[0, 0])
        real = int(np.count_nonzero(positions[0] >= 0))
        if start < 0 or start + n > self.ctx_len:
            raise BackendError(
                f"{self.name}: a call at positions {start}..{start + n - 1} does not fit the cache "
                f"({self.ctx_len} slots)"
            )
        contiguous = np.array_equal(positions[0, :real], np.arange(start, start + real))
        if not (contiguous and np.all(positions[0, real:] < 0)):
            raise BackendError(
                f"{self.name}: positions {positions[0].tolist()[:8]}... are not contiguous from the call's first",
                hint="a dflash bug in the decoding loop; run with `--set compile.ort.fuse=false` meanwhile",
            )
        b = self._binding
        for name, arr in feeds.items():
            b.bind_cpu_input(name, np.ascontiguousarray(arr))
        self._carried.bind(b)
        carried = list(self._carried.present.values())
        for name in [*self.output_names, *carried]:
            b.bind_output(name, "cpu")
        self._sess.run_with_iobinding(b)
        values = b.get_outputs()
        first = len(self._arrays)  # cache outputs were bound first
        out = {name: values[first + k].numpy() for k, name in enumerate([*self.output_names, *carried])}
        self._carried.update(out)
        return {name: out[name] for name in self.output_names}
