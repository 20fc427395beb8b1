"""-1 padding and rejected-block rollback never corrupt a live cache slot (module and ONNX graph)."""

from __future__ import annotations

import json

import numpy as np
import onnxruntime as ort
import torch

from dflash_cli.decoding.target_calls import padded
from dflash_cli.modeling.layers import write_cache


def test_write_cache_sends_padding_to_the_spare_slot_only():
    cache = torch.zeros(1, 2, 10, 4)
    new = torch.ones(1, 2, 5, 4)
    pos = torch.tensor([[3, 4, 5, -1, -1]])
    out = write_cache(cache, pos, new)
    assert out[:, :, 3:6].eq(1).all()
    untouched = [i for i in range(9) if i not in (3, 4, 5)]
    assert out[:, :, untouched].eq(0).all()  # every other live slot unchanged
    assert out[:, :, 9].eq(1).all()  # the spare slot took the padding


class Graph:
    """Raw ONNX Runtime session over a compiled graph, threading the retained state by hand."""

    def __init__(self, compile_dir, name):
        info = json.loads((compile_dir / "export.json").read_text())
        self.sess = ort.InferenceSession(str(compile_dir / info["graphs"][name]["onnx"]))
        self.cache_in = [i for i in self.sess.get_inputs() if i.name.startswith("past_")]
        self.outputs = [o.name for o in self.sess.get_outputs()]
        self.reset()

    def reset(self):
        self.cache = {i.name: np.zeros(i.shape, np.float32) for i in self.cache_in}

    def __call__(self, **feeds):
        res = dict(zip(self.outputs, self.sess.run(None, {**feeds, **self.cache})))
        self.cache = {n: res[f"{n}_RetainedState"] for n in self.cache}
        return res


def _graph(qwen3_engine, name):
    return Graph(qwen3_engine.compile_dir, name)


def test_padded_prefill_leaves_free_slots_untouched(qwen3_engine):
    g = _graph(qwen3_engine, "target")
    P, C = qwen3_engine.prefill_len, qwen3_engine.ctx_len
    prompt = [5, 6, 7]
    ids, pos = padded(prompt, 0, P)
    g(input_ids=ids, position_ids=pos)
    for name, kv in g.cache.items():
        assert np.abs(kv[:, :, :3]).sum() > 0, name  # the live slots were written
        assert not np.any(kv[:, :, 3 : C - 1]), name  # padding wrote nothing but the spare slot


def test_rejected_block_is_rolled_back_implicitly(qwen3_engine):
    """prefill, verify a block of which only 2 tokens are kept, verify the next block ==
    prefill of the kept tokens, verify the same next block."""
    g = _graph(qwen3_engine, "target")
    B, P = qwen3_engine.block_size, qwen3_engine.prefill_len
    prompt = [9, 10, 11, 12, 13]
    block = [20, 21, 22, 23][:B]
    nxt = [30, 31, 32, 33][:B]
    a = 1  # keep block[0..a]; block[a+1..] were rejected
    n = len(prompt)
    g(**dict(zip(("input_ids", "position_ids"), padded(prompt, 0, P))))
    g(**dict(zip(("input_ids", "position_ids"), padded(block, n, B))))
    got = g(**dict(zip(("input_ids", "position_ids"), padded(nxt, n + a + 1, B))))
    g.reset()
    g(**dict(zip(("input_ids", "position_ids"), padded(prompt + block[: a + 1], 0, P))))
    ref = g(**dict(zip(("input_ids", "position_ids"), padded(nxt, n + a + 1, B))))
    assert np.array_equal(got["tokens"], ref["tokens"])
    np.testing.assert_allclose(got["context_features"], ref["context_features"], atol=1e-5)


def test_draft_context_is_exactly_the_committed_context(qwen3_engine):
    """Context fed in two calls (as after prefill then a verify) == the same context in one call:
    the block's own K/V never stay in the draft cache."""
    g = _graph(qwen3_engine, "draft")
    B, P, mask = qwen3_engine.block_size, qwen3_engine.prefill_len, qwen3_engine.mask_token_id
    H = g.sess.get_inputs()[2].shape[-1]
    rng = np.random.default_rng(0)
    feats = rng.standard_normal((7, H)).astype(np.float32)

    def call(ctx, first, block_pos):
        c = np.zeros((1, len(ctx) if len(ctx) in (B, P) else P, H), np.float32)
        c[0, : len(ctx)] = ctx
        _, cpos = padded([0] * len(ctx), first, c.shape[1])
        ids, bpos = padded([4] + [mask] * (B - 1), block_pos, B)
        return g(input_ids=ids, position_ids=bpos, context_features=c, context_position_ids=cpos)

    call(feats[:5], 0, 5)
    got = call(feats[5:7], 5, 7)
    g.reset()
    ref = call(feats[:7], 0, 7)
    assert np.array_equal(got["draft_tokens"], ref["draft_tokens"])
