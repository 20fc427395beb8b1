"""QaicSession against a FAKE `qaicrt` / `QAicApi_pb2` (the SDK runtime is not on this machine).

The fake mimics only the calls the session makes, as QEfficient uses the real API; these
tests pin our side of the contract (which buffers are sent, how outputs are decoded), not the
device's behaviour.
"""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from dflash_cli.errors import BackendError
from dflash_cli.qaic import runtime
from dflash_cli.qaic.runtime import QaicSession, open_qaic_session

FLOAT, FLOAT16, INT64 = 1, 2, 3
IN, OUT = 0, 1
CACHE = [1, 2, 16, 4]


def _descriptor() -> dict:
    """A target-like program: 1 layer, fp16 KV (custom IO), logits returned as fp16."""
    bindings = [
        ("input_ids", INT64, IN, [1, 8]),
        ("position_ids", INT64, IN, [1, 8]),
        ("past_key.0", FLOAT16, IN, CACHE),
        ("past_value.0", FLOAT16, IN, CACHE),
        ("tokens", INT64, OUT, [1, 8]),
        ("logits", FLOAT16, OUT, [1, 8, 32]),
        ("context_features", FLOAT, OUT, [1, 8, 8]),
        ("past_key.0_RetainedState", FLOAT16, OUT, CACHE),
        ("past_value.0_RetainedState", FLOAT16, OUT, CACHE),
    ]

    def shapes(seq: int) -> list:
        dims = {
            "input_ids": [1, seq],
            "position_ids": [1, seq],
            "tokens": [1, seq],
            "logits": [1, seq, 32],
            "context_features": [1, seq, 8],
        }
        return [{"type": t, "dims": dims.get(n, d)} for n, t, _, d in bindings]

    return {
        "bindings": [
            {"name": n, "index": i, "type": t, "dir": io, "dims": d} for i, (n, t, io, d) in enumerate(bindings)
        ],
        "allowed_shapes": [shapes(8), shapes(4)],  # Prefill, Verify
    }


def make_fake_runtime(timeout_property: str) -> tuple[types.ModuleType, types.ModuleType, list]:
    calls: list = []  # (buffers as bytes, dims) per setData
    aicapi = types.ModuleType("QAicApi_pb2")
    aicapi.FLOAT_TYPE, aicapi.FLOAT_16_TYPE, aicapi.INT64_I_TYPE = FLOAT, FLOAT16, INT64
    aicapi.BUFFER_IO_TYPE_INPUT, aicapi.BUFFER_IO_TYPE_OUTPUT = IN, OUT

    class IoDesc:
        def ParseFromString(self, raw: bytes) -> None:
            data = json.loads(raw)
            self.selected_set = SimpleNamespace(bindings=[SimpleNamespace(**b) for b in data["bindings"]])
            self.allowed_shapes = [
                SimpleNamespace(shapes=[SimpleNamespace(**s) for s in a]) for a in data["allowed_shapes"]
            ]

    aicapi.IoDesc = IoDesc
    rt = types.ModuleType("qaicrt")
    rt.QStatus = SimpleNamespace(QS_SUCCESS="ok", QS_ERROR="error")
    rt.QIDList = list
    rt.BufferDimensionsVecRef = list

    class QBuffer:
        def __init__(self, data: bytes) -> None:
            self.data = bytes(data)
            self.size = len(self.data)

        def __bytes__(self) -> bytes:
            return self.data

    class Context:
        def __init__(self, devices: list | None = None) -> None:
            self.devices = devices

    class Queue:
        def __init__(self, context: Context, device: int) -> None:
            self.device = device

        def enqueue(self, exec_obj: ExecObj) -> str:
            return "ok"

    class Qpc:
        def __init__(self, path: str) -> None:
            self.path = path

        def getIoDescriptor(self) -> tuple[str, bytes]:
            return "ok", json.dumps(_descriptor()).encode()

    class QAicProgramProperties:
        pass

    setattr(QAicProgramProperties, timeout_property, 0)

    class Program:
        def __init__(self, context: Context, device: int | None, qpc: Qpc, props: object) -> None:
            self.device, self.props, self.active = device, props, False
            calls.append(("program", device, getattr(props, timeout_property)))

        def load(self) -> str:
            return "ok"

        def activate(self) -> None:
            self.active = True
            calls.append(("activate",))

        def deactivate(self) -> None:
            self.active = False
            calls.append(("deactivate",))

    class ExecObj:
        def __init__(self, context: Context, program: Program) -> None:
            self.buffers: list = []
            self.dims: list = []

        def setData(self, buffers: list, dims: list) -> str:
            self.buffers, self.dims = buffers, dims
            calls.append(("setData", [b.data for b in buffers], [tuple(d[1]) for d in dims]))
            return "ok"

        def waitForCompletion(self) -> str:
            return "ok"

        def getData(self) -> tuple[str, list]:
            # Outputs sized as the host buffers say: tokens = input_ids + 1, logits = 0.5 (fp16).
            ids = np.frombuffer(self.buffers[0].data, np.int64)
            out = list(self.buffers)
            out[4] = QBuffer((ids + 1).tobytes())
            out[5] = QBuffer(np.full(self.dims[5][1], 0.5, np.float16).tobytes())
            out[6] = QBuffer(np.full(self.dims[6][1], 2.0, np.float32).tobytes())
            return "ok", out

    for cls in (QBuffer, Context, Queue, Qpc, QAicProgramProperties, Program, ExecObj):
        setattr(rt, cls.__name__, cls)
    return rt, aicapi, calls


@pytest.fixture(params=["dataPathTimeoutMs", "SubmitRetryTimeoutMs"])
def fake(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> tuple:
    rt, aicapi, calls = make_fake_runtime(request.param)
    # Injected through sys.modules, the way the real modules would be found after import_runtime's path setup.
    monkeypatch.setitem(sys.modules, "qaicrt", rt)
    monkeypatch.setitem(sys.modules, "QAicApi_pb2", aicapi)
    return rt, aicapi, calls, request.param


def _feeds(seq: int) -> dict[str, np.ndarray]:
    return {"input_ids": np.arange(seq, dtype=np.int32).reshape(1, seq), "position_ids": np.arange(seq).reshape(1, seq)}


def _session(tmp_path: Path, **kw: object) -> QaicSession:
    qpc = tmp_path / "target" / "qpc"
    qpc.mkdir(parents=True, exist_ok=True)
    (qpc / "programqpc.bin").write_bytes(b"fake")
    return open_qaic_session(tmp_path, "target", 3, **kw)


def test_names_and_timeout_property(fake: tuple, tmp_path: Path) -> None:
    _, _, calls, timeout_property = fake
    session = _session(tmp_path)
    assert session.input_names == ["input_ids", "position_ids"]
    assert session.output_names == ["tokens", "logits", "context_features"]
    assert session.timeout_property == timeout_property
    assert calls[0] == ("program", 3, runtime.DEFAULT_TIMEOUT_MS)


def test_run_sets_inputs_by_name_and_casts_outputs(fake: tuple, tmp_path: Path) -> None:
    _, _, calls, _ = fake
    session = _session(tmp_path)
    out = session.run(_feeds(8))
    _, data, dims = calls[-1]
    # Inputs land at their binding index, converted to the binding's dtype (int32 -> int64).
    assert data[0] == np.arange(8, dtype=np.int64).tobytes()
    assert data[1] == np.arange(8, dtype=np.int64).tobytes()
    # The cache is never fed, not even as zeros on a fresh session's first call: cache inputs and
    # retained-state outputs are always size 0 (they stay on the device).
    assert data[2] == b"" and data[3] == b"" and dims[2] == (0,)
    assert data[7] == b"" and data[8] == b"" and dims[7] == (0,)
    # Outputs: this specialization's shapes; fp16 logits come back as float32.
    assert out["tokens"].dtype == np.int64 and out["tokens"].tolist() == [list(range(1, 9))]
    assert out["logits"].dtype == np.float32 and out["logits"].shape == (1, 8, 32)
    assert np.all(out["logits"] == 0.5)
    assert out["context_features"].dtype == np.float32 and set(out) == {"tokens", "logits", "context_features"}

    out = session.run(_feeds(4))  # the Verify specialization
    _, data, dims = calls[-1]
    assert data[2] == b"" and data[3] == b"" and dims[2] == (0,)  # cache now stays on the device
    assert dims[5] == (1, 4, 32) and out["logits"].shape == (1, 4, 32)


def test_reset_keeps_the_device_cache_and_feeds_nothing(fake: tuple, tmp_path: Path) -> None:
    _, _, calls, _ = fake
    session = _session(tmp_path)
    session.run(_feeds(8))
    n = len(calls)
    session.reset()
    assert len(calls) == n  # no deactivate/activate, no transfer
    session.run(_feeds(8))
    assert calls[-1][1][2] == b"" and calls[-1][1][3] == b""


def test_unknown_reset_mode_is_refused(fake: tuple, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="reset_mode must be one of"):
        _session(tmp_path, reset_mode="zero-feed")


def test_reset_reactivate_mode(fake: tuple, tmp_path: Path) -> None:
    _, _, calls, _ = fake
    session = _session(tmp_path, reset_mode="reactivate")
    session.run(_feeds(8))
    assert calls[-1][1][2] == b""  # this mode never sends the cache
    session.reset()
    assert [c[0] for c in calls[-2:]] == ["deactivate", "activate"]


def test_shape_outside_specializations(fake: tuple, tmp_path: Path) -> None:
    session = _session(tmp_path)
    with pytest.raises(ValueError, match="match no compiled specialization"):
        session.run(_feeds(5))
    with pytest.raises(ValueError, match="missing inputs"):
        session.run({"input_ids": np.zeros((1, 8), np.int64)})


def test_activation_failure_names_device_and_cores(fake: tuple, tmp_path: Path, monkeypatch) -> None:
    rt = fake[0]
    _session(tmp_path)  # writes the program file
    monkeypatch.setattr(rt.Program, "activate", lambda self: "error")  # e.g. the cores are taken
    with pytest.raises(BackendError) as info:
        open_qaic_session(tmp_path, "target", 3, num_cores=8)
    assert "activating the program on device 3, 8 cores" in info.value.message
    assert "status error" in info.value.message


def test_multi_device_uses_dev_mapping(fake: tuple, tmp_path: Path) -> None:
    _session(tmp_path)  # writes the program file
    multi = QaicSession(tmp_path / "target" / "qpc", "target", [2, 3])
    assert multi._program.device is None and multi._program.props.devMapping == "2:3"


def test_missing_program_and_missing_runtime(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(BackendError, match="no compiled QAIC program"):
        open_qaic_session(tmp_path, "draft")
    monkeypatch.setenv("DFLASH_QAIC_ROOT", str(tmp_path / "no-sdk"))
    monkeypatch.setitem(sys.modules, "qaicrt", None)  # None in sys.modules makes the import fail
    with pytest.raises(BackendError, match="qaicrt"):
        runtime.import_runtime()
