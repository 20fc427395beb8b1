"""Session-wide tiny random pairs (one per family), built once and shared read-only by all tests."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

# Tests import helpers as `tests.fixtures...`; plain `pytest` (unlike `python -m pytest`) does not put
# the repo root on sys.path. Redundant once pyproject sets [tool.pytest.ini_options] pythonpath = ["."].
_ROOT = str(Path(__file__).resolve().parents[1])
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

import dflash_cli.host.ort_threads as _ort_threads  # noqa: E402
from tests.fixtures.tiny_pairs import TinyPair, make_pair  # noqa: E402

# Tests open ONNX Runtime sessions of their own (per-session pools), which ONNX Runtime refuses once a
# process has the shared pool: engines here keep a pool per session; tests/test_shared_thread_pool.py
# runs the shared pool in a process of its own.
_ort_threads.SHARED_POOL_ALLOWED = False

# Under `pytest -n 2` (make test) two workers share two cores: one torch thread each, so Hugging Face's
# reference runs do not oversubscribe the CPU (the export stage already traces on one thread).
if os.environ.get("PYTEST_XDIST_WORKER"):
    import torch

    torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_qwen3_pair(tmp_path_factory: pytest.TempPathFactory) -> TinyPair:
    """Qwen3 target (tied embeddings, 4 layers, hidden 64) + 2-layer DFlash draft, block 4."""
    return make_pair(tmp_path_factory.mktemp("tiny_qwen3_pair"), "qwen3")


@pytest.fixture(scope="session")
def tiny_llama_pair(tmp_path_factory: pytest.TempPathFactory) -> TinyPair:
    """Llama target (untied lm_head, 4 layers, hidden 64) + 2-layer Qwen3-style DFlash draft, block 4."""
    return make_pair(tmp_path_factory.mktemp("tiny_llama_pair"), "llama")


@pytest.fixture(scope="session")
def qwen3_engine(tiny_qwen3_pair: TinyPair, tmp_path_factory: pytest.TempPathFactory):
    """The tiny Qwen3 pair built by the real pipeline into its own cache, opened with ONNX Runtime."""
    from tests.engines import open_engine

    return open_engine(tiny_qwen3_pair, tmp_path_factory.mktemp("qwen3_engine"))


@pytest.fixture(scope="session")
def llama_engine(tiny_llama_pair: TinyPair, tmp_path_factory: pytest.TempPathFactory):
    from tests.engines import open_engine

    return open_engine(tiny_llama_pair, tmp_path_factory.mktemp("llama_engine"))


@pytest.fixture(scope="session")
def qwen3_logits_engine(tiny_qwen3_pair: TinyPair, tmp_path_factory: pytest.TempPathFactory):
    """The tiny Qwen3 pair exported with logits (sampling and logprobs need them)."""
    from tests.engines import open_engine

    return open_engine(tiny_qwen3_pair, tmp_path_factory.mktemp("qwen3_logits"), export={"logits": True})


@pytest.fixture(scope="session")
def qwen3_last_layer_engine(tiny_qwen3_pair: TinyPair, tmp_path_factory: pytest.TempPathFactory):
    """Taps include the target's last layer, whose Hugging Face hidden state is taken after the final norm."""
    from tests.engines import open_engine

    return open_engine(tiny_qwen3_pair, tmp_path_factory.mktemp("qwen3_last"), dflash={"target_layer_ids": [0, 3]})


@pytest.fixture(scope="session")
def shared_exports(tiny_qwen3_pair: TinyPair, tiny_llama_pair: TinyPair, tmp_path_factory: pytest.TempPathFactory):
    """The tiny pairs' exports the export tests compare, each built once per run (tests/exports.py)."""
    from tests.exports import SharedExports

    return SharedExports(
        tmp_path_factory.mktemp("shared_exports"), {"qwen3": tiny_qwen3_pair, "llama": tiny_llama_pair}
    )
