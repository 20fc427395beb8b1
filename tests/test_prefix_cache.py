"""The prefix-cache graphs ONNX Runtime runs: same outputs as the static graphs, rollback included."""

from __future__ import annotations

import json

import numpy as np
import onnx
import pytest

from dflash_cli.backends.base import proposal_rows
from dflash_cli.backends.ort import OrtSession
from dflash_cli.backends.ort_kv_inplace import OrtInPlaceKvSession
from dflash_cli.backends.ort_prefix import OrtPrefixSession, is_prefix_graph, open_prefix_session
from dflash_cli.errors import BackendError
from dflash_cli.exporting.names import PROPOSAL_ROWS


def _pair(engine, graph: str):
    info = json.loads((engine.compile_dir / "export.json").read_text())
    static = OrtSession(engine.compile_dir / info["graphs"][graph]["onnx"], graph)
    prefix = open_prefix_session(engine.compile_dir / info["graphs"][f"{graph}_prefix"]["onnx"], graph, info["ctx_len"])
    return static, prefix


def _same(a: dict, b: dict, real: np.ndarray | None = None) -> None:
    assert a.keys() == b.keys()
    for name in a:
        x, y = a[name], b[name]
        if real is not None and x.ndim >= 2 and x.shape[1] == real.size:
            x, y = x[:, real], y[:, real]
        if x.dtype.kind == "f":
            np.testing.assert_allclose(y, x, rtol=1e-4, atol=1e-5, err_msg=name)
        else:
            np.testing.assert_array_equal(y, x, err_msg=name)


def test_engine_runs_the_prefix_graphs(qwen3_engine) -> None:
    # The compiled target's attention updates the cache in place (ortcompile/gqa.py); the draft's
    # block attention is not causal, so it keeps the host-stored prefix form.
    assert isinstance(qwen3_engine.target, OrtInPlaceKvSession)
    assert isinstance(qwen3_engine.draft, OrtPrefixSession)
    info = json.loads((qwen3_engine.export_dir / "export.json").read_text())
    model = onnx.load(str(qwen3_engine.export_dir / info["graphs"]["target_prefix"]["onnx"]), load_external_data=False)
    dims = lambda vi: [d.dim_param or d.dim_value for d in vi.type.tensor_type.shape.dim]  # noqa: E731
    ins, outs = {i.name: i for i in model.graph.input}, {o.name: o for o in model.graph.output}
    assert dims(ins["past_key.0"])[:2] == ["batch", "past_len"]  # several sequences per call (serve)
    assert dims(outs["present_key.0"])[:2] == ["batch", "seq_len"]
    assert not any(name.endswith("_RetainedState") for name in outs)
    assert is_prefix_graph(qwen3_engine.compile_dir / "target_prefix.onnx")
    assert not is_prefix_graph(qwen3_engine.compile_dir / "target.onnx")


@pytest.mark.parametrize("engine_name", ["qwen3_engine", "llama_engine"])
def test_target_prefix_equals_static_through_prefill_verify_and_rollback(engine_name, request) -> None:
    engine = request.getfixturevalue(engine_name)
    static, prefix = _pair(engine, "target")
    static.reset()
    prefix.reset(fill=float("nan"))  # slots at or beyond a call's start are never read
    P, B = engine.recipe.export.prefill_seq_len, engine.block_size
    rng = np.random.default_rng(1)
    pos = np.full((1, P), -1, np.int64)
    pos[0, : P - 3] = np.arange(P - 3)
    calls = [{"input_ids": rng.integers(1, 50, (1, P)), "position_ids": pos}]
    for start in (P - 3, P - 3 + B, P - 3 + 2, P - 3 + 2 + B):  # the third call rolls back a rejected block
        calls.append({"input_ids": rng.integers(1, 50, (1, B)), "position_ids": np.arange(start, start + B)[None]})
    for feeds in calls:
        _same(static.run(feeds), prefix.run(feeds), real=feeds["position_ids"][0] >= 0)


def test_draft_prefix_equals_static(qwen3_engine) -> None:
    engine = qwen3_engine
    static, prefix = _pair(engine, "draft")
    static.reset()
    prefix.reset()
    P, B = engine.recipe.export.prefill_seq_len, engine.block_size
    hidden = static._sess.get_inputs()[2].shape[-1]
    rng = np.random.default_rng(2)
    ctx_pos = np.full((1, P), -1, np.int64)
    ctx_pos[0, :5] = np.arange(5)
    block = lambda start: {  # noqa: E731
        "input_ids": np.full((1, B), engine.mask_token_id, np.int64),
        "position_ids": np.arange(start, start + B)[None],
    }
    first = {
        **block(5),
        "context_features": rng.standard_normal((1, P, hidden)).astype(np.float32),
        "context_position_ids": ctx_pos,
    }
    second = {
        **block(8),
        "context_features": rng.standard_normal((1, 3, hidden)).astype(np.float32),
        "context_position_ids": np.arange(5, 8)[None],
    }
    for feeds in (first, second):
        _same(static.run(feeds), prefix.run(feeds))


def test_draft_prefix_heads_only_the_proposals_asked_for(qwen3_engine) -> None:
    # `proposal_rows` [1, n]: the first n proposals, equal to a whole block's first n; its shape is what counts
    engine = qwen3_engine
    _, prefix = _pair(engine, "draft")
    P, B = engine.recipe.export.prefill_seq_len, engine.block_size
    hidden = prefix._sess.get_inputs()[2].shape[-1]
    assert PROPOSAL_ROWS in prefix.input_names
    rng = np.random.default_rng(3)
    feeds = {
        "input_ids": np.full((1, B), engine.mask_token_id, np.int64),
        "position_ids": np.arange(P, P + B)[None],
        "context_features": rng.standard_normal((1, P, hidden)).astype(np.float32),
        "context_position_ids": np.arange(P)[None],
    }
    whole = prefix.run(feeds)
    assert whole["draft_tokens"].shape == (1, B - 1)
    for n in (1, 2, B - 1):
        prefix.reset()
        part = prefix.run({**feeds, PROPOSAL_ROWS: proposal_rows(n)})
        assert part["draft_tokens"].shape == (1, n)
        np.testing.assert_array_equal(part["draft_tokens"], whole["draft_tokens"][:, :n])
        np.testing.assert_allclose(part["draft_confidence"], whole["draft_confidence"][:, :n], rtol=1e-5)


def test_a_call_past_the_cache_is_refused(qwen3_engine) -> None:
    _, prefix = _pair(qwen3_engine, "target")
    ctx = prefix.ctx_len
    with pytest.raises(BackendError, match="does not fit the cache"):
        prefix.run({"input_ids": np.ones((1, 4), np.int64), "position_ids": np.arange(ctx - 2, ctx + 2)[None]})


def test_prefix_cache_off_runs_the_static_graphs(tiny_qwen3_pair, tmp_path) -> None:
    from tests.engines import open_engine

    engine = open_engine(tiny_qwen3_pair, tmp_path, compile={"backend": "ort", "ort": {"prefix_cache": False}})
    assert isinstance(engine.target, OrtSession)
    out = engine.generate([5, 6, 7, 8], mode="dflash", max_new_tokens=12)
    assert out.tokens == engine.generate([5, 6, 7, 8], mode="plain", max_new_tokens=12).tokens
