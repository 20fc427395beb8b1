"""GatedDeltaLayer (dflash_cli/modeling/gated_delta.py) against transformers' Qwen3.5 Gated DeltaNet.

Same weights (the HF layer's state_dict), fp32, tiny random config: outputs, states after a call (HF keeps them in
its DynamicCache: the last K conv inputs and the recurrent state), continuation from returned states, the exact
per-position rollback states of `forward`, and ONNX export through the dynamo exporter the repo uses.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
import torch
from transformers import DynamicCache
from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet

from dflash_cli.modeling.gated_delta import GatedDeltaLayer

HIDDEN, BATCH, PREFILL, BLOCK = 64, 2, 21, 8
TOL = {"rtol": 1e-4, "atol": 1e-5}


def _config() -> Qwen3_5TextConfig:
    return Qwen3_5TextConfig(
        hidden_size=HIDDEN,
        num_hidden_layers=1,  # layer 0 is a linear-attention layer
        intermediate_size=128,
        vocab_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        linear_conv_kernel_dim=4,
    )


@pytest.fixture(scope="module")
def layers() -> tuple[Qwen3_5GatedDeltaNet, GatedDeltaLayer, Qwen3_5TextConfig]:
    torch.manual_seed(0)
    config = _config()
    hf = Qwen3_5GatedDeltaNet(config, layer_idx=0).eval()
    with torch.no_grad():  # HF leaves these at ones; random values exercise them
        hf.dt_bias.normal_(0.0, 1.0)
        hf.norm.weight.normal_(1.0, 0.2)
    ours = GatedDeltaLayer(config).eval()
    ours.load_state_dict(hf.state_dict())
    return hf, ours, config


def _tokens(t: int, seed: int = 1) -> torch.Tensor:
    return torch.randn(BATCH, t, HIDDEN, generator=torch.Generator().manual_seed(seed))


def _hf_states(cache: DynamicCache) -> tuple[torch.Tensor, torch.Tensor]:
    """HF caches the last K conv inputs; the first of them is never read again, ours keep K-1."""
    layer = cache.layers[0]
    return layer.conv_states[0][..., 1:], layer.recurrent_states[0]


@pytest.mark.parametrize("t", [1, 3, 16, 70])
@torch.no_grad()
def test_matches_hf_from_zero_states(layers, t: int) -> None:
    hf, ours, config = layers
    x = _tokens(t)
    cache = DynamicCache(config=config)
    ref = hf(x, cache=cache)
    torch.testing.assert_close(hf(x), ref)  # the cache does not change a first call
    conv0, rec0 = ours.zero_states(BATCH)
    y, conv_states, rec_states = ours(x, conv0, rec0)
    y_chunked, conv_end, rec_end = ours.forward_chunked(x, conv0, rec0)
    torch.testing.assert_close(y, ref, **TOL)
    torch.testing.assert_close(y_chunked, ref, **TOL)
    assert conv_states.shape == (BATCH, t, ours.conv_dim, 3) and rec_states.shape == (BATCH, t, 4, 16, 16)
    hf_conv, hf_rec = _hf_states(cache)
    for conv, rec in ((conv_states[:, -1], rec_states[:, -1]), (conv_end, rec_end)):
        torch.testing.assert_close(conv, hf_conv, **TOL)
        torch.testing.assert_close(rec, hf_rec, **TOL)


@torch.no_grad()
def test_continuation_and_exact_rollback(layers) -> None:
    _, ours, _ = layers
    x = _tokens(PREFILL + BLOCK)
    conv0, rec0 = ours.zero_states(BATCH)
    whole, _, _ = ours.forward_chunked(x, conv0, rec0)
    torch.testing.assert_close(ours(x, conv0, rec0)[0], whole, **TOL)

    _, conv_p, rec_p = ours.forward_chunked(x[:, :PREFILL], conv0, rec0)
    block = x[:, PREFILL:]
    y, conv_states, rec_states = ours(block, conv_p, rec_p)
    torch.testing.assert_close(y, whole[:, PREFILL:], **TOL)
    y_chunked, conv_end, rec_end = ours.forward_chunked(block, conv_p, rec_p)
    torch.testing.assert_close(y_chunked, whole[:, PREFILL:], **TOL)
    torch.testing.assert_close(conv_states[:, -1], conv_end, **TOL)
    torch.testing.assert_close(rec_states[:, -1], rec_end, **TOL)

    exact = {"rtol": 1e-5, "atol": 1e-6}  # the input projection rounds differently for different T
    for n in range(1, BLOCK + 1):  # keeping index n-1 == having run only the first n tokens of the block
        y_n, conv_n, rec_n = ours(block[:, :n], conv_p, rec_p)
        torch.testing.assert_close(conv_states[:, n - 1], conv_n[:, -1], **exact)
        torch.testing.assert_close(rec_states[:, n - 1], rec_n[:, -1], **exact)
        torch.testing.assert_close(y[:, :n], y_n, **TOL)
        _, conv_nc, rec_nc = ours.forward_chunked(block[:, :n], conv_p, rec_p)
        torch.testing.assert_close(conv_states[:, n - 1], conv_nc, **exact)
        torch.testing.assert_close(rec_states[:, n - 1], rec_nc, **exact)
        if n < BLOCK:  # and resuming from the rolled-back state continues the sequence
            y_rest, _, _ = ours(block[:, n:], conv_states[:, n - 1], rec_states[:, n - 1])
            torch.testing.assert_close(y_rest, whole[:, PREFILL + n :], **TOL)


@torch.no_grad()
def test_states_match_hf_cache_through_decoding(layers) -> None:
    """HF prefill, then its multi-token (chunked, from the cached state) and one-token (recurrent) paths."""
    hf, ours, config = layers
    x = _tokens(PREFILL + BLOCK, seed=2)
    conv0, rec0 = ours.zero_states(BATCH)
    _, conv_p, rec_p = ours.forward_chunked(x[:, :PREFILL], conv0, rec0)
    y, conv_states, rec_states = ours(x[:, PREFILL:], conv_p, rec_p)

    block_cache = DynamicCache(config=config)
    hf(x[:, :PREFILL], cache=block_cache)
    torch.testing.assert_close((conv_p, rec_p), _hf_states(block_cache), **TOL)
    torch.testing.assert_close(y, hf(x[:, PREFILL:], cache=block_cache), **TOL)
    torch.testing.assert_close((conv_states[:, -1], rec_states[:, -1]), _hf_states(block_cache), **TOL)

    step_cache = DynamicCache(config=config)
    hf(x[:, :PREFILL], cache=step_cache)
    for n in range(1, BLOCK + 1):
        y_hf = hf(x[:, PREFILL + n - 1 : PREFILL + n], cache=step_cache)
        torch.testing.assert_close(y[:, n - 1 : n], y_hf, **TOL)
        torch.testing.assert_close((conv_states[:, n - 1], rec_states[:, n - 1]), _hf_states(step_cache), **TOL)


class _Chunked(torch.nn.Module):
    def __init__(self, layer: GatedDeltaLayer) -> None:
        super().__init__()
        self.layer = layer

    def forward(self, x, conv_state, rec_state):
        return self.layer.forward_chunked(x, conv_state, rec_state)


def _export_and_run(module, inputs, path: Path, dynamic_shapes=None, runs=()) -> None:
    names = ["x", "conv_state", "rec_state"]
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        torch.onnx.export(
            module.eval(),
            inputs,
            str(path),
            dynamo=True,
            opset_version=18,
            input_names=names,
            output_names=["y", "conv_out", "rec_out"],
            dynamic_shapes=dynamic_shapes,
            verbose=False,
        )
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    for run in (inputs, *runs):
        got = session.run(None, {n: t.numpy() for n, t in zip(names, run)})
        with torch.no_grad():
            want = module(*run)
        for g, w in zip(got, want):
            np.testing.assert_allclose(g, w.numpy(), rtol=1e-4, atol=1e-4)


def _states(layer: GatedDeltaLayer) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    conv = torch.randn(1, layer.conv_dim, layer.kernel - 1, generator=gen)
    return conv, 0.1 * torch.randn(1, layer.v_heads, layer.dk, layer.dv, generator=gen)


@pytest.mark.slow
def test_onnx_export_per_position(layers, tmp_path: Path) -> None:
    _, ours, _ = layers
    _export_and_run(ours, (_tokens(BLOCK)[:1], *_states(ours)), tmp_path / "block.onnx")


@pytest.mark.slow
def test_onnx_export_chunked(layers, tmp_path: Path) -> None:
    _, ours, _ = layers
    _export_and_run(_Chunked(ours), (_tokens(70)[:1], *_states(ours)), tmp_path / "chunked.onnx")


@pytest.mark.slow
def test_onnx_export_symbolic_block_length(layers, tmp_path: Path) -> None:
    """One graph with a symbolic T serves blocks of 1..64 tokens (fixed number of squarings)."""
    _, ours, _ = layers
    seq = torch.export.Dim("seq_len", min=1, max=64)
    runs = [(_tokens(t, seed=t)[:1], *_states(ours)) for t in (1, 3, 40, 64)]
    dynamic = {"x": {1: seq}, "conv_state": None, "rec_state": None}
    _export_and_run(ours, (_tokens(BLOCK)[:1], *_states(ours)), tmp_path / "dyn.onnx", dynamic, runs)
