"""ONNX Runtime session in the retained-state convention, KV cache kept in place via IO binding.

Two cache buffer sets ping-pong: a call reads set A and writes set B, the next reads B and writes
A. Both bindings are made once, so a decode step only binds the small per-call inputs and never
copies the cache through Python.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from dflash_cli.backends.base import SessionTraits, is_cache_input, is_kv_input, retained_name
from dflash_cli.errors import BackendError
from dflash_cli.host.ort_threads import apply_thread_pool
from dflash_cli.vision.feeds import VisionFeeder

_OPT_LEVELS = {
    "disable": "ORT_DISABLE_ALL",
    "basic": "ORT_ENABLE_BASIC",
    "extended": "ORT_ENABLE_EXTENDED",
    "all": "ORT_ENABLE_ALL",
}


@dataclass(frozen=True)
class OrtSettings:
    intra_op_threads: int = 0  # 0 = ONNX Runtime's default (one per physical core)
    graph_optimization: str = "all"
    provider: str = "auto"  # auto | cpu | cuda
    allow_spinning: bool = False  # see OrtConfig.allow_spinning


def resolve_provider(requested: str) -> str:
    import onnxruntime as ort

    available = ort.get_available_providers()
    if requested == "cuda" and "CUDAExecutionProvider" not in available:
        raise BackendError(
            "ONNX Runtime has no CUDA provider here",
            hint="install onnxruntime-gpu on a CUDA machine, or use `--set compile.ort.provider=cpu`",
        )
    if requested in ("cuda", "auto") and "CUDAExecutionProvider" in available:
        return "CUDAExecutionProvider"
    return "CPUExecutionProvider"


def session_options(settings: OrtSettings, initializers: dict | None = None):
    """SessionOptions from our settings; `initializers`: name -> OrtValue replacing the graph's own."""
    import onnxruntime as ort

    opts = ort.SessionOptions()
    for init_name, value in (initializers or {}).items():
        opts.add_initializer(init_name, value)
    opts.graph_optimization_level = getattr(ort.GraphOptimizationLevel, _OPT_LEVELS[settings.graph_optimization])
    if settings.intra_op_threads:
        opts.intra_op_num_threads = settings.intra_op_threads
    opts.log_severity_level = 3
    opts.add_session_config_entry("session.intra_op.allow_spinning", "1" if settings.allow_spinning else "0")
    apply_thread_pool(opts)  # allow_spinning configures per-session pools; the shared one keeps ORT's default (spin)
    return opts


def cpu_session(onnx_path: Path, name: str, kind: str, settings: OrtSettings | None, initializers: dict | None):
    """(provider, InferenceSession) for a graph whose KV cache lives in host memory: CPU provider only."""
    import onnxruntime as ort

    provider = resolve_provider((settings or OrtSettings()).provider)
    if provider != "CPUExecutionProvider":
        raise BackendError(
            f"the {kind} {name} graph runs on the CPU provider only (its KV cache lives in host memory)",
            hint="open the static graph for other providers",
        )
    opts = session_options(settings or OrtSettings(), initializers)
    return provider, ort.InferenceSession(str(onnx_path), sess_options=opts, providers=[provider])


class OrtSession(SessionTraits):
    def __init__(
        self, onnx_path: Path, name: str, settings: OrtSettings = OrtSettings(), initializers: dict | None = None
    ) -> None:
        """`initializers`: name -> OrtValue replacing the graph's own (shared, memory-mapped tables)."""
        import onnxruntime as ort

        opts = session_options(settings, initializers)
        self.provider = resolve_provider(settings.provider)
        self.name = name
        self._sess = ort.InferenceSession(str(onnx_path), sess_options=opts, providers=[self.provider])
        self._device = "cuda" if self.provider == "CUDAExecutionProvider" else "cpu"
        inputs = self._sess.get_inputs()
        self.cache_names = [i.name for i in inputs if is_cache_input(i.name)]
        self.input_names = [i.name for i in inputs if not is_cache_input(i.name)]
        self.output_names = [o.name for o in self._sess.get_outputs() if not o.name.endswith("_RetainedState")]
        self.vision = VisionFeeder(inputs)
        dtype = {"tensor(float)": np.float32, "tensor(float16)": np.float16, "tensor(int64)": np.int64}
        self._cache_spec = {i.name: (tuple(i.shape), dtype[i.type]) for i in inputs if is_cache_input(i.name)}
        kv = [shape for n, (shape, _) in self._cache_spec.items() if is_kv_input(n)]
        self.ctx_len = kv[0][2] if kv else 0
        self._buffers = [self._alloc(), self._alloc()]
        self._bindings = [
            self._bind(self._buffers[0], self._buffers[1]),
            self._bind(self._buffers[1], self._buffers[0]),
        ]
        self._parity = 0

    def _alloc(self) -> dict:
        import onnxruntime as ort

        return {
            n: ort.OrtValue.ortvalue_from_numpy(np.zeros(shape, dt), self._device, 0)
            for n, (shape, dt) in self._cache_spec.items()
        }

    def _bind(self, src: dict, dst: dict):
        b = self._sess.io_binding()
        for n in self.cache_names:
            b.bind_ortvalue_input(n, src[n])
            b.bind_ortvalue_output(retained_name(n), dst[n])
        for n in self.output_names:
            b.bind_output(n, "cpu")
        return b

    def reset(self, fill: float = 0.0) -> None:
        """Start a new sequence. `fill` other than 0 stands in for what an accelerator's retained
        buffers may hold (the fp16 emulation fills NaN: the graph must ignore slots nobody wrote)."""
        for buffers in self._buffers:
            for n, (shape, dt) in self._cache_spec.items():
                # Integer state (a hybrid target's row positions) has no NaN: -1 is "nothing there".
                value = fill if np.issubdtype(dt, np.floating) or fill == 0.0 else -1
                buffers[n].update_inplace(np.full(shape, value, dt))
        self._parity = 0

    def run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        feeds = self.vision.complete(feeds)
        b = self._bindings[self._parity]
        for n, arr in feeds.items():
            b.bind_cpu_input(n, arr)
        for n in self.output_names:  # shapes follow seq_len: let ORT allocate them afresh
            b.bind_output(n, "cpu")
        self._sess.run_with_iobinding(b)
        outs = b.get_outputs()
        self._parity ^= 1
        # get_outputs() lists outputs in binding order: cache outputs first, then ours.
        first = len(self.cache_names)
        return {n: outs[first + i].numpy() for i, n in enumerate(self.output_names)}
