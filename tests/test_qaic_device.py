"""On-card rung (marker `qaic`): compile the tiny graphs with the real SDK and run them.

Skipped unless /opt/qti-aic (or $DFLASH_QAIC_ROOT) has a compiler and `qaic-util -q` shows a
ready card. It checks exactly what the fake-runtime tests cannot: that retained state carries
the cache between calls, that reset() restarts a sequence without feeding the cache, and that
outputs decode to the right shapes and dtypes. Compared with ONNX Runtime fp32 within fp16
tolerance.

The second part builds a real tiny pair through the pipeline with `compile.backend=qaic` at
ctx_len 4096, opens target and draft together with the recipe's placement (both programs on one
card, half the cores each), and decodes from a prompt that leaves a padded prefill chunk, across
position 2048: DFlash must equal plain greedy decoding of the same compiled target, and the
target must agree with ONNX Runtime fp32 teacher-forced.
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


LONG_CTX = 4096


@pytest.fixture(scope="module")
def card_pair(tiny_qwen3_pair, tmp_path_factory: pytest.TempPathFactory):
    """(QAIC engine, ORT engine) for the same tiny pair at ctx_len 4096, the recipe's default placement."""
    qid = _ready_device()
    if qid is None:
        pytest.skip("needs the QAIC SDK and a ready Cloud AI 100 card")
    from tests.engines import open_engine

    settings = {"export": {"ctx_len": LONG_CTX, "prefill_seq_len": 64}}
    qaic = open_engine(
        tiny_qwen3_pair,
        tmp_path_factory.mktemp("card_pair"),
        compile={"backend": "qaic", "qaic": {"num_cores": 16, "devices": [qid]}},
        **settings,
    )
    ort_engine = open_engine(tiny_qwen3_pair, tmp_path_factory.mktemp("card_pair_ort"), **settings)
    return qaic, ort_engine


def _long_prompt(engine, length: int) -> list[int]:
    from dflash_cli.readiness.fp16_bands import corpus_tokens

    return corpus_tokens(lambda text: list(engine.tokenizer(text)["input_ids"]), length)


def test_two_programs_share_a_card_and_decode_across_2048(card_pair) -> None:
    qaic, _ = card_pair
    # 2037 is not a multiple of the prefill length: the last prefill chunk is padded.
    prompt = _long_prompt(qaic, 2037)
    plain = qaic.generate(prompt, mode="plain", max_new_tokens=48)
    dflash = qaic.generate(prompt, mode="dflash", max_new_tokens=48)  # the draft opens beside the target
    assert len(plain.tokens) == 48 and 2037 + 48 > 2048
    assert dflash.tokens == plain.tokens  # lossless on the same compiled target, across position 2048


def test_target_agrees_with_ort_fp32_at_long_positions(card_pair) -> None:
    from dflash_cli.readiness.fp16_bands import make_bands, teacher_forced

    qaic, ort_engine = card_pair
    bands = make_bands(LONG_CTX)
    tokens = _long_prompt(qaic, LONG_CTX)

    class _Fill:  # the card's session resets without a fill value: its buffers are never fed
        def __init__(self, inner):
            self.inner = inner

        def reset(self, fill=0.0):
            self.inner.reset()

        def run(self, feeds):
            return self.inner.run(feeds)

    teacher_forced(ort_engine.target, _Fill(qaic.target), tokens, bands, 64, 8)
    for band in bands:
        assert band.nonfinite == 0, band.label
        assert band.agreement >= 0.9, (band.label, band.agreement)
