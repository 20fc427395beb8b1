"""Gemma 4's vision path (modeling/vision_gemma4.py) against Hugging Face's, on a tiny random
Gemma4ForConditionalGeneration and its own Pillow image processor: per image, our module's
`vision_embeds` == `Gemma4Model.get_image_features` (the rows put at the image's soft tokens), and one
ONNX graph with a symbolic soft-token count == torch for images of two sizes."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

from dflash_cli.modeling.vision_gemma4 import (
    CHECKPOINT_PREFIXES,
    INPUTS,
    OUTPUTS,
    STRIP,
    Gemma4VisionEncoder,
    tower_inputs,
)

# (height, width) of the source images: square, and wide (resized by the processor to 60 x 144)
SIZES = ((96, 96), (60, 140))


@pytest.fixture(scope="module")
def hf_and_ours():
    from transformers import Gemma4Config, Gemma4ForConditionalGeneration

    torch.manual_seed(0)
    cfg = Gemma4Config(
        text_config=dict(
            vocab_size=128, hidden_size=40, intermediate_size=80, num_hidden_layers=2, num_attention_heads=2,
            num_key_value_heads=1, head_dim=16, global_head_dim=16, vocab_size_per_layer_input=128,
            hidden_size_per_layer_input=8, sliding_window=16, layer_types=["sliding_attention", "full_attention"],
        ),  # fmt: skip
        vision_config=dict(
            hidden_size=32, intermediate_size=56, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
            head_dim=16, patch_size=4, pooling_kernel_size=3, position_embedding_size=64,
            use_clipped_linears=True, standardize=True,
        ),  # fmt: skip
        audio_config=None,
        boi_token_id=120, eoi_token_id=121, image_token_id=122, video_token_id=123,
        boa_token_id=124, eoa_token_index=125, audio_token_id=126,
    )  # fmt: skip
    hf = Gemma4ForConditionalGeneration(cfg).eval()
    # Random values for everything HF initialises to a constant (norm weights, the position table,
    # the standardize buffers, clip bounds tight enough that they clip)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, t in hf.named_parameters():
            if "vision" in name and "norm" in name:
                t.copy_(1 + 0.2 * torch.randn(t.shape, generator=gen))
        table = hf.model.vision_tower.patch_embedder.position_embedding_table
        table.copy_(0.5 * torch.randn(table.shape, generator=gen))
        for name, t in hf.model.vision_tower.named_buffers():
            if name.endswith(("_min", "_max")):
                bound = 0.3 + torch.rand((), generator=gen)
                t.fill_(-bound if name.endswith("_min") else bound)
        hf.model.vision_tower.std_bias.copy_(0.3 * torch.randn(32, generator=gen))
        hf.model.vision_tower.std_scale.copy_(0.5 + torch.rand(32, generator=gen))

    ours = Gemma4VisionEncoder(cfg).eval()
    state = {k.removeprefix(STRIP): v for k, v in hf.state_dict().items() if k.startswith(CHECKPOINT_PREFIXES)}
    ours.load_state_dict(state, strict=True)  # every tensor by its checkpoint name, none missing or left over
    return hf, ours


def _processed():
    """Both images through Gemma 4's own Pillow processor in one batch (each padded to 70 * 9 patches)."""
    from PIL import Image
    from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil

    processor = Gemma4ImageProcessorPil(patch_size=4, max_soft_tokens=70, pooling_kernel_size=3)
    rng = np.random.default_rng(5)
    images = [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for h, w in SIZES]
    return processor(images=images, return_tensors="pt")


def test_module_equals_hf_image_features(hf_and_ours) -> None:
    hf, ours = hf_and_ours
    batch = _processed()
    assert batch["num_soft_tokens_per_image"].tolist() == [64, 60]  # 24x24 and 15x36 patches over 3x3 windows
    with torch.no_grad():
        want = hf.model.get_image_features(batch["pixel_values"], batch["image_position_ids"]).pooler_output
        for i, expected in enumerate(want):
            feeds = tower_inputs(batch["pixel_values"][i], batch["image_position_ids"][i], hf.config)
            assert list(feeds) == list(INPUTS)
            got = ours(*(torch.from_numpy(feeds[n]) for n in INPUTS))
            assert got.shape == expected.shape == (batch["num_soft_tokens_per_image"][i], 40)
            torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)


def test_one_onnx_graph_serves_both_sizes(hf_and_ours, tmp_path) -> None:
    import onnx
    import onnxruntime as ort

    hf, ours = hf_and_ours
    batch = _processed()
    feeds = [tower_inputs(batch["pixel_values"][i], batch["image_position_ids"][i], hf.config) for i in range(2)]
    path = tmp_path / "vision.onnx"
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        torch.onnx.export(
            ours,
            tuple(torch.from_numpy(feeds[1][n]) for n in INPUTS),
            str(path),
            dynamo=False,
            opset_version=17,
            input_names=list(INPUTS),
            output_names=list(OUTPUTS),
            dynamic_axes={**{n: {0: "soft_tokens"} for n in INPUTS}, OUTPUTS[0]: {0: "soft_tokens"}},
        )
    ops = {node.op_type for node in onnx.load(str(path)).graph.node}
    assert "MatMul" in ops and "Gemm" not in ops and "Clip" not in ops
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    for feed in feeds:
        (got,) = session.run(None, feed)
        with torch.no_grad():
            want = ours(*(torch.from_numpy(feed[n]) for n in INPUTS)).numpy()
        assert got.shape == want.shape
        np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)
