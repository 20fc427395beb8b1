"""On-card rung (marker `qaic`): compile the tiny graphs with the real SDK and run them.

Skipped unless /opt/qti-aic (or $DFLASH_QAIC_ROOT) has a compiler and `qaic-util -q` shows a
ready card. It checks exactly what the fake-runtime tests cannot: that retained state carries
the cache between calls, that the zero-feed reset restarts a sequence, and that outputs
decode to the right shapes and dtypes. Compared with ONNX Runtime fp32 within fp16 tolerance.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest

from dflash_cli.qaic.command import QaicCompileOptions
from dflash_cli.qaic.compile import compile_graphs
from dflash_cli.qaic.runtime import open_qaic_session
from dflash_cli.qaic.sdk import find_sdk, query_devices
from tests.qaic_graphs import TinyDims, write_export_dir

pytestmark = pytest.mark.qaic
D = TinyDims()


def _ready_device() -> int | None:
    sdk = find_sdk()
    if sdk.compiler is None:
        return None
    return next((d.qid for d in query_devices(sdk) if d.ready), None)


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, int]:
    qid = _ready_device()
    if qid is None:
        pytest.skip("needs the QAIC SDK and a ready Cloud AI 100 card")
    tmp = tmp_path_factory.mktemp("qaic_device")
    export = write_export_dir(tmp / "export", D)
    compile_graphs(export, tmp / "compiled", QaicCompileOptions(num_cores=1, devices=[qid]))
    return export, tmp / "compiled", qid


def _ort_steps(export: Path, steps: list[dict[str, np.ndarray]]) -> list[dict[str, np.ndarray]]:
    """Reference: ORT fp32 with the retained-state outputs fed back as the next cache."""
    session = ort.InferenceSession(str(export / "target.onnx"))
    names = [o.name for o in session.get_outputs()]
    shape = (1, D.kv_heads, D.ctx_len, D.head_dim)
    cache = {f"past_{k}.{i}": np.zeros(shape, np.float32) for i in range(D.target_layers) for k in ("key", "value")}
    results = []
    for feeds in steps:
        out = dict(zip(names, session.run(None, {**feeds, **cache})))
        cache = {n: out[f"{n}_RetainedState"] for n in cache}
        results.append(out)
    return results


def test_target_prefill_then_verify_matches_ort(built: tuple[Path, Path, int]) -> None:
    export, compiled, qid = built
    prefill = {
        "input_ids": np.array([[3, 14, 15, 9, 26, 0, 0, 0]], np.int64),
        "position_ids": np.array([[0, 1, 2, 3, 4, -1, -1, -1]], np.int64),
    }
    verify = {"input_ids": np.array([[5, 6, 7, 8]], np.int64), "position_ids": np.arange(5, 9).reshape(1, 4)}
    ref = _ort_steps(export, [prefill, verify])
    session = open_qaic_session(compiled, "target", qid)
    for _ in range(2):  # the second round checks that reset() really restarts the sequence
        session.reset()
        got = [session.run(prefill), session.run(verify)]
        for step_ref, step_got in zip(ref, got):
            assert step_got["logits"].dtype == np.float32
            np.testing.assert_allclose(step_got["logits"], step_ref["logits"], rtol=5e-2, atol=5e-2)
            np.testing.assert_array_equal(step_got["tokens"][:, :4], step_ref["tokens"][:, :4])
