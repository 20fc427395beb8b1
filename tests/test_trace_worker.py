"""The export's forked tracer: the same bytes as tracing in one process, and never needed for them."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import pytest

from dflash_cli.exporting import graphs, trace_worker
from tests.exports import export

pytestmark = pytest.mark.slow  # exports pairs: left out of `make test-fast`

FILES = [f"{g}.onnx{ext}" for g in ("target", "target_prefix", "draft", "draft_prefix") for ext in ("", ".data")]
forks = pytest.mark.skipif(not trace_worker.usable(), reason="one core or no fork here: the export never forks")


def _same_files(a: Path, b: Path) -> None:
    for name in FILES:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name


def test_usable_only_when_allowed(monkeypatch) -> None:
    monkeypatch.setenv("DFLASH_EXPORT_WORKERS", "0")
    assert not trace_worker.usable()


@forks
def test_forked_traces_give_the_same_bytes(shared_exports) -> None:
    _same_files(shared_exports.get("qwen3", "in-process"), shared_exports.get("qwen3", "replicated"))


@forks
@pytest.mark.parametrize(
    "trouble",
    [
        pytest.param(lambda: (_ for _ in ()).throw(RuntimeError("child bug")), id="raises"),
        pytest.param(lambda: os.kill(os.getpid(), signal.SIGKILL), id="killed"),
        pytest.param(lambda: time.sleep(60), id="stuck"),
    ],
)
def test_the_parent_traces_what_the_child_did_not_deliver(shared_exports, tmp_path, monkeypatch, trouble) -> None:
    monkeypatch.setattr(trace_worker, "WAIT_FLOOR_S", 2.0)  # give up on the stuck child quickly
    monkeypatch.setattr(trace_worker, "PATIENCE", 0.0)
    parent, real = os.getpid(), graphs._trace

    def trace(*args, **kwargs):
        if os.getpid() != parent:  # the child (only) misbehaves before its first trace
            trouble()
        return real(*args, **kwargs)

    monkeypatch.setattr(graphs, "_trace", trace)
    export(shared_exports.injected("qwen3"), tmp_path / "recovered")
    _same_files(shared_exports.get("qwen3", "in-process"), tmp_path / "recovered")


def test_no_process_to_spare_means_tracing_here(shared_exports, tmp_path, monkeypatch) -> None:
    def cannot_fork(*args, **kwargs):
        raise OSError("Resource temporarily unavailable")

    monkeypatch.setattr(trace_worker, "TraceWorker", cannot_fork)
    export(shared_exports.injected("qwen3"), tmp_path / "here")
    _same_files(shared_exports.get("qwen3", "in-process"), tmp_path / "here")


def test_pack_leaves_no_weight_bytes_and_unpack_restores_the_sources(shared_exports) -> None:
    import onnx
    import onnx_ir as ir

    from dflash_cli.exporting.names import WRAPPER_PREFIX

    model = onnx.load(str(shared_exports.get("qwen3", "replicated") / "draft.onnx"), load_external_data=False)
    template = ir.serde.deserialize_model(model)
    weights = [v.name for v in template.graph.initializers.values()][:3]
    sources = {n.removeprefix(WRAPPER_PREFIX): object() for n in weights}
    blob = trace_worker.pack(template, {n: sources[n.removeprefix(WRAPPER_PREFIX)] for n in weights})
    assert len(blob) < model.ByteSize() + 4096  # placeholders only, no tensor data was read
    back, by_graph_name = trace_worker.unpack(blob, sources)
    assert by_graph_name == {n: sources[n.removeprefix(WRAPPER_PREFIX)] for n in weights}
    assert all(type(back.graph.initializers[n].const_value).__name__ == "LazyTensor" for n in weights)


@forks
def test_ctrl_c_is_the_parents_to_handle() -> None:
    worker = trace_worker.TraceWorker([60.0], time.sleep)
    try:
        time.sleep(1.0)  # let the child install its handlers
        os.kill(worker._proc.pid, signal.SIGINT)
        time.sleep(0.5)
        assert worker._proc.is_alive()  # a Ctrl-C does not make the child print a traceback and die
    finally:
        worker.close()
    assert not worker._proc.is_alive()


@forks
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the child is tied to its parent on Linux")
def test_a_killed_build_takes_the_child_with_it(tmp_path) -> None:
    import subprocess

    script = (
        "import os, signal, time\n"
        "from dflash_cli.exporting import trace_worker\n"
        "w = trace_worker.TraceWorker([600.0], time.sleep)\n"
        "print(w._proc.pid, flush=True)\n"
        "time.sleep(1.0)\n"
        "os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    with (tmp_path / "out").open("w") as out:  # a file, not a pipe the child would hold open
        subprocess.run([sys.executable, "-c", script], stdout=out, timeout=120)
    child = int((tmp_path / "out").read_text().split()[0])
    for _ in range(50):
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            return
        time.sleep(0.1)
    os.kill(child, signal.SIGKILL)
    pytest.fail("the forked tracer outlived its killed build")
