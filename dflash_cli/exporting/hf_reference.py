"""Hugging Face's own models as the references export validation compares our graphs with.

The text model of a target (its causal LM, or ours around its text model where the family has no causal-LM
class), built on the meta device around the very tensors our module holds, and the vision towers of the
vision-language families with the inputs they are checked on. Readiness reads a target's text LM here too.
"""

from __future__ import annotations

from pathlib import Path

import torch


class TextPathLM(torch.nn.Module):
    """Hugging Face's own language model of a multimodal family (Qwen3-VL's text model, which has no
    causal-LM class) under an lm_head: what the multimodal model computes on a text-only prompt."""

    def __init__(self, cfg) -> None:
        from transformers import AutoModel

        super().__init__()
        self.model = AutoModel.from_config(cfg, dtype=torch.float32)
        self.lm_head = torch.nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)

    def forward(self, input_ids, output_hidden_states: bool = False):
        from types import SimpleNamespace

        out = self.model(input_ids=input_ids, output_hidden_states=output_hidden_states, use_cache=False)
        return SimpleNamespace(logits=self.lm_head(out.last_hidden_state), hidden_states=out.hidden_states)


def hf_text_lm(target_dir: Path):
    """Hugging Face's causal LM of an artifact's target (its text path), weights loaded, float32, eval."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from dflash_cli.checkpoints.weights import WeightStore

    cfg = AutoConfig.from_pretrained(str(target_dir))
    checkpoint_dtype = getattr(cfg, "dtype", None)
    try:
        model = AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=torch.float32).eval()
        scale_embeddings_as_checkpoint(model, checkpoint_dtype)
        return model
    except ValueError:  # no causal-LM class (Qwen3-VL's text model): ours around theirs
        with torch.device("meta"):
            model = TextPathLM(cfg)
        store = WeightStore.open(target_dir)
        state = {n: store.get(n, torch.float32) for n, _ in model.named_parameters()}
        model.load_state_dict(state, strict=True, assign=True)
        fresh_rotary(model, cfg)
        return model.eval()


def scale_embeddings_as_checkpoint(model, checkpoint_dtype) -> None:
    """Gemma 4's scaled embedding multiplies by sqrt(hidden) in the weights' dtype: running a bf16 checkpoint,
    Hugging Face uses bf16(sqrt(5376)) = 73.5, as our graphs do; a float32 model would use 73.32 and differ
    from both by 0.25%."""
    from dflash_cli.modeling.gemma4_target import embed_scale

    for module in model.modules():
        if hasattr(module, "scalar_embed_scale") and hasattr(module, "embed_scale"):
            module.embed_scale = torch.tensor(embed_scale(module.embedding_dim, checkpoint_dtype))


def fresh_rotary(model, cfg) -> None:
    """Rotary tables are buffers computed at construction, not checkpoint weights: rebuild on the CPU the ones
    a model built on the meta device lacks."""
    for _, module in model.named_modules():
        meta = [n for n, b in module.named_buffers(recurse=False) if b.is_meta]
        if meta and any(n.endswith("inv_freq") for n in meta):  # one table, or one per layer kind (Gemma 4)
            with torch.device("cpu"):
                fresh = type(module)(config=cfg)
            for name in meta:
                setattr(module, name, getattr(fresh, name))
        elif meta == ["embed_scale"] and hasattr(module, "scalar_embed_scale"):  # Gemma 4's scaled embedding
            module.embed_scale = torch.tensor(module.scalar_embed_scale)  # scale_embeddings_as_checkpoint sets it


def _causal_lm(cfg):
    from transformers import AutoModelForCausalLM

    try:
        return AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    except ValueError:  # no causal-LM class for this text config
        return TextPathLM(cfg)


def hf_model_holding(cfg, target):
    """The Hugging Face model of `cfg`, holding the same tensors as our target module (no second copy)."""
    checkpoint_dtype = getattr(cfg, "dtype", None)  # building the model in float32 sets cfg.dtype to it
    with torch.device("meta"):
        hf = _causal_lm(cfg)
    from dflash_cli.modeling.moe import to_hf_state

    state = {k: v for k, v in target.state_dict().items() if not k.startswith(("dflash.", "rotary."))}
    state = to_hf_state(state, cfg)
    missing, unexpected = hf.load_state_dict(state, strict=False, assign=True)
    if getattr(cfg, "tie_word_embeddings", False):
        hf.lm_head.weight = hf.model.embed_tokens.weight
    fresh_rotary(hf, cfg)
    scale_embeddings_as_checkpoint(hf, checkpoint_dtype)
    leftover = [n for n, p in [*hf.named_parameters(), *hf.named_buffers()] if p.is_meta]
    if leftover:
        raise RuntimeError(f"Hugging Face model has unfilled tensors: {leftover[:5]}")
    return hf.eval()


# Two images' patch grids (t, h, w): a rectangle and a small square, each a whole number of merge units.
CHECK_GRIDS = ((1, 4, 6), (1, 2, 2))


def hf_module(module_cls_or_config, store, rename, cfg=None):
    """A Hugging Face module built on the meta device, its parameters and buffers from the store."""
    from transformers import AutoModel

    with torch.device("meta"):
        if cfg is None:
            hf = AutoModel.from_config(module_cls_or_config, dtype=torch.float32)
        else:
            hf = module_cls_or_config(*cfg)
    names = [n for n, _ in [*hf.named_parameters(), *hf.named_buffers()] if rename(n) in store]
    hf.load_state_dict({n: store.get(rename(n), torch.float32) for n in names}, strict=False, assign=True)
    return hf.eval()


def qwen3_vl_tower_references(src: Path, full_cfg):
    import numpy as np

    from dflash_cli.checkpoints.weights import WeightStore
    from dflash_cli.vision.images import tower_inputs

    cfg = full_cfg.vision_config
    hf = hf_module(cfg, WeightStore.open(src / "target"), lambda n: "visual." + n)
    fresh_rotary(hf, cfg)
    rng = np.random.default_rng(0)
    width = cfg.in_channels * cfg.temporal_patch_size * cfg.patch_size**2
    for grid in CHECK_GRIDS:
        pixels = rng.standard_normal((int(np.prod(grid)), width)).astype(np.float32)
        with torch.no_grad():
            ref = hf(torch.from_numpy(pixels), grid_thw=torch.tensor([grid]))
        wanted = {"vision_embeds": ref.pooler_output.numpy()}
        if getattr(ref, "deepstack_features", None):  # Qwen3.5's tower has none
            wanted["deepstack_embeds"] = torch.stack(ref.deepstack_features).numpy()
        yield "image {}x{}".format(*grid[1:]), tower_inputs(pixels, grid, cfg), wanted


def gemma4_tower_references(src: Path, full_cfg):
    """Gemma 4: Hugging Face's tower then its multimodal embedder, on patch grids of pooling windows."""
    import numpy as np
    from transformers.models.gemma4.modeling_gemma4 import Gemma4MultimodalEmbedder

    from dflash_cli.checkpoints.weights import WeightStore
    from dflash_cli.modeling.vision_gemma4 import tower_inputs

    vcfg = full_cfg.vision_config
    store = WeightStore.open(src / "target")
    tower = hf_module(vcfg, store, lambda n: "vision_tower." + n)
    fresh_rotary(tower, vcfg)
    embedder = hf_module(Gemma4MultimodalEmbedder, store, lambda n: "embed_vision." + n, (vcfg, full_cfg.text_config))
    k, width = vcfg.pooling_kernel_size, 3 * vcfg.patch_size**2
    rng = np.random.default_rng(0)
    for _, rows, cols in CHECK_GRIDS:  # patch rows and columns: whole pooling windows
        h, w = rows * k // 2, cols * k // 2
        positions = np.array([(x, y) for y in range(h) for x in range(w)], np.int64)
        pixels = rng.random((len(positions), width), dtype=np.float32)
        with torch.no_grad():
            pooled = tower(torch.from_numpy(pixels)[None], torch.from_numpy(positions)[None]).last_hidden_state
            ref = embedder(inputs_embeds=pooled)
        wanted = {"vision_embeds": ref.reshape(-1, ref.shape[-1]).numpy()}
        yield f"image {h}x{w} patches", tower_inputs(pixels, positions, full_cfg), wanted
