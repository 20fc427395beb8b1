"""A position's outputs do not depend on how many rows its call had (backends/single_row.py).

Greedy DFlash compares a verify block's rows with what plain decoding (one-token calls) would give;
ONNX Runtime's one-row kernels round differently, so one-token target calls run as two rows.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from dflash_cli.backends.single_row import first_row, pad_single_row
from dflash_cli.ortcompile.checks import call_length_invariance


def _info(engine) -> tuple[dict, int]:
    info = json.loads((engine.compile_dir / "export.json").read_text())
    return info, json.loads((engine.compile_dir / "pair.json").read_text())["vocab_size"]


@pytest.mark.parametrize("engine_name", ["qwen3_engine", "llama_engine"])
def test_block_rows_equal_one_token_calls(engine_name, request) -> None:
    engine = request.getfixturevalue(engine_name)
    facts = json.loads((engine.compile_dir / "compile.json").read_text())
    assert "call length" in facts["checks"]
    assert set(facts["prefix_call_length_max_diff"].values()) == {0.0}
    info, vocab = _info(engine)
    assert set(call_length_invariance(engine.target, info, vocab, seed=7).values()) == {0.0}


def test_the_check_catches_a_call_length_dependence(qwen3_engine) -> None:
    class OneRowRoundsDifferently:  # what an unpadded one-row kernel path does: the last bit moves
        def __init__(self, inner):
            self.inner = inner

        def reset(self):
            self.inner.reset()

        def run(self, feeds):
            out = self.inner.run(feeds)
            if feeds["position_ids"].shape[1] == 1:
                out["context_features"] = np.nextafter(out["context_features"], np.inf)
            return out

    info, vocab = _info(qwen3_engine)
    moved = call_length_invariance(OneRowRoundsDifferently(qwen3_engine.target), info, vocab)
    assert moved["context_features"] > 0 and moved["tokens"] == 0.0


def test_a_target_found_call_length_dependent_runs_its_static_graph(qwen3_engine, tmp_path) -> None:
    from dflash_cli.backends.ort import OrtSession
    from dflash_cli.decoding.engine import _open

    src = qwen3_engine.compile_dir
    for f in src.iterdir():
        (tmp_path / f.name).symlink_to(f)
    facts = json.loads((src / "compile.json").read_text())
    (tmp_path / "compile.json").unlink()
    (tmp_path / "compile.json").write_text(json.dumps(facts))
    assert not isinstance(_open("ort", tmp_path, "target", qwen3_engine.recipe), OrtSession)
    (tmp_path / "compile.json").write_text(json.dumps(facts | {"prefix_target_lossless": False}))
    assert isinstance(_open("ort", tmp_path, "target", qwen3_engine.recipe), OrtSession)


@pytest.mark.parametrize("engine_name", ["qwen3_engine", "llama_engine"])
def test_the_build_says_how_one_token_calls_run_and_the_engine_follows(engine_name, request) -> None:
    engine = request.getfixturevalue(engine_name)
    facts = json.loads((engine.compile_dir / "compile.json").read_text())
    assert facts["prefix_one_token_calls"] in ("one row", "two rows")
    assert engine.target.pad_single_rows == (facts["prefix_one_token_calls"] == "two rows")


def test_a_one_token_call_at_the_last_slot_runs(qwen3_engine) -> None:
    """The attention pads it to two rows in the graph: the padding row lands in the buffer's spare slot."""
    sess = qwen3_engine.target
    sess.reset()
    last = sess.ctx_len - 1
    out = sess.run({"input_ids": np.array([[3]]), "position_ids": np.array([[last]])})
    assert all(np.isfinite(v).all() for v in out.values() if v.dtype.kind == "f")
    sess.reset()


def test_one_token_target_calls_run_as_two_rows(qwen3_engine, monkeypatch) -> None:
    sess = qwen3_engine.target
    monkeypatch.setattr(sess, "pad_single_rows", True)
    seen = []
    real = type(sess)._run
    monkeypatch.setattr(type(sess), "_run", lambda self, feeds: seen.append(feeds["position_ids"]) or real(self, feeds))
    sess.reset()
    sess.run({"input_ids": np.array([[5, 6, 7]]), "position_ids": np.array([[0, 1, 2]])})
    out = sess.run({"input_ids": np.array([[8]]), "position_ids": np.array([[3]])})
    assert [p.tolist() for p in seen] == [[[0, 1, 2]], [[3, 4]]]
    assert all(v.shape[1] == 1 for v in out.values() if v.ndim >= 2)
    # The last cache slot has no room for a second row: that call runs alone.
    last = sess.ctx_len - 1
    sess.run({"input_ids": np.array([[8]]), "position_ids": np.array([[last]])})
    assert seen[-1].tolist() == [[last]]
    sess.reset()


def test_padding_helpers() -> None:
    feeds = {"input_ids": np.array([[9]]), "position_ids": np.array([[4]])}
    padded, done = pad_single_row(feeds, ctx_len=16)
    assert done and padded["input_ids"].tolist() == [[9, 9]] and padded["position_ids"].tolist() == [[4, 5]]
    assert pad_single_row({"input_ids": np.array([[1, 2]]), "position_ids": np.array([[0, 1]])}, 16)[1] is False
    assert pad_single_row({"input_ids": np.array([[1]]), "position_ids": np.array([[-1]])}, 16)[1] is False
    out = first_row({"tokens": np.array([[3, 4]]), "context_features": np.zeros((1, 2, 8)), "scalar": np.array(1)})
    assert out["tokens"].tolist() == [[3]] and out["context_features"].shape == (1, 1, 8)


def test_two_rows_compute_what_a_block_computes_at_real_sizes() -> None:
    """What the padding relies on, at Qwen3's attention sizes: GroupQueryAttention's rows of a two-row call
    are bit-equal to the same rows of a 16-row call (ONNX Runtime's kernels, not our graph)."""
    import onnxruntime as ort
    from onnx import TensorProto, helper

    heads, kv_heads, d, ctx, past = 16, 8, 128, 256, 100
    angle = np.arange(ctx)[:, None] / (10000 ** (np.arange(0, d, 2) / d))[None]
    cos, sin = np.cos(angle).astype(np.float32), np.sin(angle).astype(np.float32)
    node = helper.make_node(
        "GroupQueryAttention",
        ["q", "k", "v", "pk", "pv", "seqlens_k", "total", "cos", "sin"],
        ["o", "ok", "ov"],
        domain="com.microsoft",
        num_heads=heads,
        kv_num_heads=kv_heads,
        do_rotary=1,
    )
    f = TensorProto.FLOAT
    ins = [
        helper.make_tensor_value_info("q", f, [1, "s", heads * d]),
        helper.make_tensor_value_info("k", f, [1, "s", kv_heads * d]),
        helper.make_tensor_value_info("v", f, [1, "s", kv_heads * d]),
        helper.make_tensor_value_info("pk", f, [1, kv_heads, "p", d]),
        helper.make_tensor_value_info("pv", f, [1, kv_heads, "p", d]),
        helper.make_tensor_value_info("seqlens_k", TensorProto.INT32, [1]),
        helper.make_tensor_value_info("total", TensorProto.INT32, []),
    ]
    outs = [helper.make_tensor_value_info(n, f, None) for n in ("o", "ok", "ov")]
    inits = [helper.make_tensor("cos", f, cos.shape, cos.ravel()), helper.make_tensor("sin", f, sin.shape, sin.ravel())]
    model = helper.make_model(
        helper.make_graph([node], "g", ins, outs, inits),
        opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)],
    )
    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 2
    sess = ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(0)
    cache_k = rng.standard_normal((1, kv_heads, ctx, d)).astype(np.float32)
    cache_v = rng.standard_normal((1, kv_heads, ctx, d)).astype(np.float32)
    q = rng.standard_normal((1, 16, heads * d)).astype(np.float32)
    k = rng.standard_normal((1, 16, kv_heads * d)).astype(np.float32)
    v = rng.standard_normal((1, 16, kv_heads * d)).astype(np.float32)

    def rows(step: int) -> np.ndarray:
        pk, pv, got = cache_k.copy(), cache_v.copy(), []
        for i in range(0, 16, step):
            n = past + i + step
            feeds = {"q": q[:, i : i + step], "k": k[:, i : i + step], "v": v[:, i : i + step], "pk": pk, "pv": pv}
            feeds |= {"seqlens_k": np.array([n - 1], np.int32), "total": np.array(n, np.int32)}
            o, pk, pv = sess.run(None, feeds)
            got.append(o)
        return np.concatenate(got, axis=1)

    block = rows(16)
    pairs = rows(2)
    assert np.array_equal(block, pairs)


def test_the_check_covers_calls_longer_than_a_block(qwen3_engine) -> None:
    """The hybrid's lookup steps verify up to LOOKUP_BLOCKS blocks: a kernel that rounds differently only
    on such long calls must be caught too."""

    class LongCallsRoundDifferently:
        def __init__(self, inner, rows):
            self.inner, self.rows = inner, rows

        def reset(self):
            self.inner.reset()

        def run(self, feeds):
            out = self.inner.run(feeds)
            if feeds["position_ids"].shape[1] > self.rows:
                out["context_features"] = np.nextafter(out["context_features"], np.inf)
            return out

    info, vocab = _info(qwen3_engine)
    B = info["block_size"]
    assert set(call_length_invariance(LongCallsRoundDifferently(qwen3_engine.target, B), info, vocab).values()) != {0.0}
    assert (
        call_length_invariance(LongCallsRoundDifferently(qwen3_engine.target, 10**6), info, vocab)["context_features"]
        == 0.0
    )
