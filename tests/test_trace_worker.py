"""The export's forked tracer: the same bytes as tracing in one process, and never needed for them."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
import torch

from dflash_cli.exporting import graphs, trace_worker
from dflash_cli.exporting.graphs import PairShape, export_pair
from dflash_cli.modeling.loading import load_pair_info
from tests.fixtures.tiny_pairs import TinyPair

FILES = [f"{g}.onnx{ext}" for g in ("target", "target_prefix", "draft", "draft_prefix") for ext in ("", ".data")]


def _export(src: Path, out: Path, workers: str, **env: str) -> None:
    """Export the pair's four graphs into `out` with DFLASH_EXPORT_WORKERS=`workers` (and `env` set)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DFLASH_EXPORT_WORKERS", workers)
        for name, value in env.items():
            mp.setenv(name, value)
        pair = load_pair_info(src)
        shape = PairShape(pair["block_size"], 2 * pair["block_size"], 96, pair["hidden_size"])
        out.mkdir()
        export_pair(src, out, shape, dtype=torch.float32, logits=True, opset=18, progress=lambda m: None)


@pytest.fixture(scope="module")
def single(tiny_qwen3_pair: TinyPair, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The tiny pair's inject artifact and its graphs exported in one process (the reference)."""
    from tests.test_export_replicate import _inject

    root = tmp_path_factory.mktemp("trace_worker")
    src = _inject(tiny_qwen3_pair, root / "build")
    _export(src, root / "single", "0")
    return {"src": src, "single": root / "single"}


def _same_files(a: Path, b: Path) -> None:
    for name in FILES:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name


def test_usable_only_when_allowed(monkeypatch) -> None:
    monkeypatch.setenv("DFLASH_EXPORT_WORKERS", "0")
    assert not trace_worker.usable()


def test_forked_traces_give_the_same_bytes(single, tmp_path) -> None:
    if not trace_worker.usable():
        pytest.skip("one core or no fork here: the export never forks")
    _export(single["src"], tmp_path / "forked", "1")
    _same_files(single["single"], tmp_path / "forked")


def _child_trouble(monkeypatch, act) -> None:
    """Make the forked child (only) misbehave with `act()` before its first trace."""
    parent, real = os.getpid(), graphs._trace

    def trace(*args, **kwargs):
        if os.getpid() != parent:
            act()
        return real(*args, **kwargs)

    monkeypatch.setattr(graphs, "_trace", trace)


@pytest.mark.parametrize(
    "trouble",
    [
        pytest.param(lambda: (_ for _ in ()).throw(RuntimeError("child bug")), id="raises"),
        pytest.param(lambda: os.kill(os.getpid(), signal.SIGKILL), id="killed"),
        pytest.param(lambda: time.sleep(60), id="stuck"),
    ],
)
def test_the_parent_traces_what_the_child_did_not_deliver(single, tmp_path, monkeypatch, trouble) -> None:
    if not trace_worker.usable():
        pytest.skip("one core or no fork here: the export never forks")
    monkeypatch.setattr(trace_worker, "WAIT_FLOOR_S", 2.0)  # give up on the stuck child quickly
    monkeypatch.setattr(trace_worker, "PATIENCE", 0.0)
    _child_trouble(monkeypatch, trouble)
    _export(single["src"], tmp_path / "recovered", "1")
    _same_files(single["single"], tmp_path / "recovered")


def test_pack_leaves_no_weight_bytes_and_unpack_restores_the_sources(single) -> None:
    import onnx

    from dflash_cli.exporting.torch_to_onnx import WRAPPER_PREFIX

    model = onnx.load(str(single["single"] / "draft.onnx"), load_external_data=False)
    import onnx_ir as ir

    template = ir.serde.deserialize_model(model)
    weights = [v.name for v in template.graph.initializers.values()][:3]
    sources = {n.removeprefix(WRAPPER_PREFIX): object() for n in weights}
    blob = trace_worker.pack(template, {n: sources[n.removeprefix(WRAPPER_PREFIX)] for n in weights})
    assert len(blob) < model.ByteSize() + 4096  # placeholders only, no tensor data was read
    back, by_graph_name = trace_worker.unpack(blob, sources)
    assert {n: s for n, s in by_graph_name.items()} == {n: sources[n.removeprefix(WRAPPER_PREFIX)] for n in weights}
    assert all(type(back.graph.initializers[n].const_value).__name__ == "LazyTensor" for n in weights)


def test_ctrl_c_is_the_parents_to_handle() -> None:
    if not trace_worker.usable():
        pytest.skip("one core or no fork here: the export never forks")
    worker = trace_worker.TraceWorker([60.0], time.sleep)
    try:
        time.sleep(1.0)  # let the child install its handlers
        os.kill(worker._proc.pid, signal.SIGINT)
        time.sleep(0.5)
        assert worker._proc.is_alive()  # a Ctrl-C does not make the child print a traceback and die
    finally:
        worker.close()
    assert not worker._proc.is_alive()


def test_no_process_to_spare_means_tracing_here(single, tmp_path, monkeypatch) -> None:
    def cannot_fork(*args, **kwargs):
        raise OSError("Resource temporarily unavailable")

    monkeypatch.setattr(graphs, "TraceWorker", cannot_fork)
    _export(single["src"], tmp_path / "here", "1")
    _same_files(single["single"], tmp_path / "here")


def test_a_killed_build_takes_the_child_with_it(tmp_path) -> None:
    import subprocess
    import sys

    if not trace_worker.usable() or not sys.platform.startswith("linux"):
        pytest.skip("the child is tied to its parent on Linux with fork only")
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
