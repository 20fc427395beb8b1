"""RMSNorm stays finite and right when a compiler computes it in fp16, for |x| up to 1e4.

The one-pass form squares x: x^2 overflows fp16 for |x| > 256 and the token normalises to 0.
Residual streams of real Llama / Qwen models carry channels of 1e3-1e4, so the exported RMSNorm
scales x before squaring. Both forms are exported and run through the fp16 emulation.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
import torch

from dflash_cli.modeling.layers import RMSNorm, rms_normalize
from dflash_cli.readiness.fp16 import to_fp16
from dflash_cli.readiness.fp16_lint import fp16_hazards

DIM = 128


class OnePassNorm(torch.nn.Module):
    """What graph revisions up to 4 exported."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(DIM))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))


def _export(module: torch.nn.Module, path: Path) -> Path:
    torch.onnx.export(
        module.eval(),
        (torch.randn(6, DIM),),
        str(path),
        input_names=["x"],
        output_names=["y"],
        dynamo=True,
        opset_version=18,
    )
    return path


@pytest.fixture(scope="module")
def graphs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("rmsnorm")
    return {
        "new": _export(RMSNorm(DIM, 1e-6), tmp / "new.onnx"),
        "old": _export(OnePassNorm(), tmp / "old.onnx"),
    }


def _inputs() -> np.ndarray:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((6, DIM)).astype(np.float32)
    x[1] *= 1e-3  # a quiet token (embedding-sized values)
    x[2, 5] = 300.0  # just past where x^2 overflows fp16
    x[3, 5], x[3, 9] = 1e4, -1e4  # massive-activation channels
    x[4] *= 1e3  # every channel large
    x[5, 0] = 6e4  # near fp16's max
    return x


def _reference(x: np.ndarray) -> np.ndarray:
    x64 = x.astype(np.float64)
    return x64 / np.sqrt((x64**2).mean(-1, keepdims=True) + 1e-6)


def _run_fp16(path: Path, tmp_path: Path, x: np.ndarray) -> np.ndarray:
    half = to_fp16(path, tmp_path / f"{path.stem}16.onnx")
    return ort.InferenceSession(str(half), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]


def test_two_pass_norm_is_finite_and_close_in_fp16(graphs: dict[str, Path], tmp_path: Path) -> None:
    x = _inputs()
    y = _run_fp16(graphs["new"], tmp_path, x)
    assert np.isfinite(y).all()
    np.testing.assert_allclose(y, _reference(x), atol=2e-2, rtol=2e-2)


def test_one_pass_norm_breaks_in_fp16_so_the_emulation_can_fail(graphs: dict[str, Path], tmp_path: Path) -> None:
    x = _inputs()
    y = _run_fp16(graphs["old"], tmp_path, x)
    ok = np.isclose(y, _reference(x), atol=2e-2, rtol=2e-2).all(axis=-1)
    assert ok[0] and ok[1]  # ordinary rows are fine ...
    assert not ok[2:].any()  # ... every row with |x| > 256 collapses


def test_two_pass_norm_equals_one_pass_in_fp32() -> None:
    x = torch.from_numpy(_inputs()).double()
    ref = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
    torch.testing.assert_close(rms_normalize(x, 1e-6), ref, rtol=1e-12, atol=1e-12)


def test_lint_names_the_unscaled_square(graphs: dict[str, Path]) -> None:
    import onnx

    kinds = lambda p: {h.kind for h in fp16_hazards(onnx.load(str(p)))}  # noqa: E731
    assert kinds(graphs["old"]) == {"rmsnorm-unscaled"}
    assert kinds(graphs["new"]) == set()
