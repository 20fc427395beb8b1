"""Random-weight target/draft pairs with the real configs of the pairs our recipes name.

No hub here, so the configs are written from the public model cards (Qwen3-0.6B/4B/8B,
Llama-3.1-8B-Instruct) and the z-lab DFlash drafts' layout (5 Qwen3-style layers, block 16).
Weights are random bf16, saved as sharded safetensors one shard at a time (memory stays near one
shard), with a byte-level tokenizer whose vocabulary covers every embedding row.

    python benchmarks/random_pairs.py qwen3-4b /data/pairs       # -> /data/pairs/qwen3-4b/{target,draft}
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

SHARD_BYTES = 2 * 1024**3

QWEN3_SPECIAL = {"<|endoftext|>": 151643, "<|im_start|>": 151644, "<|im_end|>": 151645, "<|mask|>": 151669}
LLAMA_SPECIAL = {
    "<|begin_of_text|>": 128000,
    "<|end_of_text|>": 128001,
    "<|reserved_special_token_0|>": 128002,
    "<|eom_id|>": 128008,
    "<|eot_id|>": 128009,
}


def _qwen3(hidden: int, layers: int, heads: int, inter: int, tie: bool) -> dict:
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "intermediate_size": inter,
        "vocab_size": 151936,
        "max_position_embeddings": 40960,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000,
        "tie_word_embeddings": tie,
        "attention_bias": False,
        "hidden_act": "silu",
        "bos_token_id": 151643,
        "eos_token_id": 151645,
        "torch_dtype": "bfloat16",
    }


LLAMA31_8B = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 4096,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "intermediate_size": 14336,
    "vocab_size": 128256,
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "rope_scaling": {
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
    "tie_word_embeddings": False,
    "attention_bias": False,
    "mlp_bias": False,
    "hidden_act": "silu",
    "bos_token_id": 128000,
    "eos_token_id": [128001, 128008, 128009],
    "torch_dtype": "bfloat16",
}

QWEN35_SPECIAL = {"<|endoftext|>": 248044, "<|im_start|>": 248045, "<|im_end|>": 248046, "<|mask|>": 248070}


def _qwen3_5(hidden: int, inter: int, tie: bool, layers: int = 32) -> dict:
    """Qwen3.5 dense (9B / 4B model cards): 32 layers, every fourth gated full attention (16 heads, 4 KV heads
    of 256, rotary on 64 dims), the rest Gated DeltaNet (16 key heads, 32 value heads, 128-wide, conv 4).
    Published in the multimodal layout: the text config nested in text_config."""
    text = {
        "model_type": "qwen3_5_text",
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": 16,
        "num_key_value_heads": 4,
        "head_dim": 256,
        "intermediate_size": inter,
        "vocab_size": 248320,
        "max_position_embeddings": 262144,
        "rms_norm_eps": 1e-6,
        "layer_types": ["full_attention" if i % 4 == 3 else "linear_attention" for i in range(layers)],
        "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": 128,
        "linear_value_head_dim": 128,
        "linear_num_key_heads": 16,
        "linear_num_value_heads": 32,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 10000000,
            "partial_rotary_factor": 0.25,
            "mrope_section": [11, 11, 10],
            "mrope_interleaved": True,
        },
        "tie_word_embeddings": tie,
        "attention_bias": False,
        "hidden_act": "silu",
        "bos_token_id": 248044,
        "eos_token_id": 248046,
        "torch_dtype": "bfloat16",
    }
    return {
        "architectures": ["Qwen3_5ForConditionalGeneration"],
        "model_type": "qwen3_5",
        "text_config": text,
        "vision_config": {"model_type": "qwen3_5_vision", "depth": 27, "hidden_size": 1152, "out_hidden_size": hidden},
        "tie_word_embeddings": tie,
        "torch_dtype": "bfloat16",
    }


def _qwen3_moe(layers: int = 48) -> dict:
    """Qwen3-Coder-30B-A3B-Instruct (model card): 48 layers of Qwen3 attention (32 heads, 4 KV heads of 128)
    with a sparse MLP each: 128 experts of width 768, 8 chosen per token, no shared expert."""
    cfg = _qwen3(2048, layers, 32, 6144, False)
    cfg |= {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "num_key_value_heads": 4}
    cfg |= {"num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768, "norm_topk_prob": True}
    cfg |= {"decoder_sparse_step": 1, "mlp_only_layers": [], "rope_theta": 10000000, "max_position_embeddings": 262144}
    return cfg


GPT_OSS_SPECIAL = {"<|startoftext|>": 199998, "<|endoftext|>": 199999, "<|mask|>": 200000, "<|return|>": 200002}


def _gpt_oss(layers: int = 24) -> dict:
    """gpt-oss-20b (model card / config.json): 24 layers alternating a 128-token window and full attention,
    64 query heads and 8 KV heads of 64 with sinks and biases, YaRN; 32 experts of width 2880, 4 per token,
    stored in MXFP4 (`quantization_config`)."""
    return {
        "architectures": ["GptOssForCausalLM"],
        "model_type": "gpt_oss",
        "hidden_size": 2880,
        "num_hidden_layers": layers,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "head_dim": 64,
        "intermediate_size": 2880,
        "num_local_experts": 32,
        "num_experts_per_tok": 4,
        "sliding_window": 128,
        "layer_types": ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(layers)],
        "vocab_size": 201088,
        "rms_norm_eps": 1e-5,
        "rope_theta": 150000,
        "rope_scaling": {
            "rope_type": "yarn",
            "factor": 32.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
            "original_max_position_embeddings": 4096,
        },
        "max_position_embeddings": 131072,
        "swiglu_limit": 7.0,
        "attention_bias": True,
        "tie_word_embeddings": False,
        "bos_token_id": 199998,
        "eos_token_id": 200002,
        "pad_token_id": 199999,
        "quantization_config": {
            "quant_method": "mxfp4",
            "modules_to_not_convert": [
                "model.layers.*.self_attn",
                "model.layers.*.mlp.router",
                "model.embed_tokens",
                "lm_head",
            ],
        },  # fmt: skip
        "torch_dtype": "bfloat16",
    }


def gpt_oss_layer_shapes(c: dict, prefix: str) -> dict[str, tuple[int, ...]]:
    """A gpt-oss layer as published: biased attention with sinks, a biased router, MXFP4 experts."""
    H, d, E, inter = c["hidden_size"], c["head_dim"], c["num_local_experts"], c["intermediate_size"]
    q, kv = c["num_attention_heads"] * d, c["num_key_value_heads"] * d
    shapes = {"input_layernorm.weight": (H,), "post_attention_layernorm.weight": (H,)}
    for w, out, inp in (("q", q, H), ("k", kv, H), ("v", kv, H), ("o", H, q)):
        shapes |= {f"self_attn.{w}_proj.weight": (out, inp), f"self_attn.{w}_proj.bias": (out,)}
    shapes |= {"self_attn.sinks": (c["num_attention_heads"],), "mlp.router.weight": (E, H), "mlp.router.bias": (E,)}
    for w, out, inp in (("gate_up_proj", 2 * inter, H), ("down_proj", H, inter)):
        e = f"mlp.experts.{w}"
        shapes |= {e + "_blocks": (E, out, inp // 32, 16), e + "_scales": (E, out, inp // 32), e + "_bias": (E, out)}
    return {prefix + k: v for k, v in shapes.items()}


def _qwen3_vl_8b() -> dict:
    """Qwen3-VL-8B-Instruct's config as its model card gives it: Qwen3-8B's language model with interleaved
    M-RoPE, a 27-block vision tower (patch 16, 2x2 merge) with deepstack features after blocks 8, 16, 24."""
    text = _qwen3(4096, 36, 32, 12288, False) | {
        "model_type": "qwen3_vl_text",
        "max_position_embeddings": 262144,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 5000000,
            "mrope_section": [24, 20, 20],
            "mrope_interleaved": True,
        },
    }
    del text["rope_theta"], text["architectures"]
    vision = {
        "model_type": "qwen3_vl",
        "depth": 27,
        "hidden_size": 1152,
        "hidden_act": "gelu_pytorch_tanh",
        "intermediate_size": 4304,
        "num_heads": 16,
        "in_channels": 3,
        "patch_size": 16,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "out_hidden_size": 4096,
        "num_position_embeddings": 2304,
        "deepstack_visual_indexes": [8, 16, 24],
    }
    return {
        "architectures": ["Qwen3VLForConditionalGeneration"],
        "model_type": "qwen3_vl",
        "text_config": text,
        "vision_config": vision,
        "image_token_id": 151655,
        "video_token_id": 151656,
        "vision_start_token_id": 151652,
        "vision_end_token_id": 151653,
        "tie_word_embeddings": False,
    }


QWEN3_VL_SPECIAL = QWEN3_SPECIAL | {
    "<|vision_start|>": 151652,
    "<|vision_end|>": 151653,
    "<|image_pad|>": 151655,
    "<|video_pad|>": 151656,
}
# Qwen3-VL's image processor settings (its preprocessor_config.json): 16-pixel patches, 2x2 merge
QWEN3_VL_PREPROCESSOR = {
    "image_processor_type": "Qwen2VLImageProcessor",
    "patch_size": 16,
    "temporal_patch_size": 2,
    "merge_size": 2,
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
    "size": {"shortest_edge": 65536, "longest_edge": 16777216},
}


def _gemma4_31b(layers: int = 60) -> dict:
    """Gemma 4 31B's text model (model card and the implementations that run it: 60 layers, five 1024-token
    window layers to one global; 32 query heads; window layers 16 KV heads of 256, global layers 4 KV heads
    of 512 whose values are their keys' projection, a quarter rotated; logits capped at 30; no per-layer
    embeddings), as Gemma4ForCausalLM's text config."""
    return {
        "architectures": ["Gemma4ForCausalLM"],
        "model_type": "gemma4_text",
        "vocab_size": 262144,
        "hidden_size": 5376,
        "intermediate_size": 21504,
        "num_hidden_layers": layers,
        "num_attention_heads": 32,
        "num_key_value_heads": 16,
        "head_dim": 256,
        "global_head_dim": 512,
        "num_global_key_value_heads": 4,
        "attention_k_eq_v": True,
        "hidden_activation": "gelu_pytorch_tanh",
        "max_position_embeddings": 262144,
        "rms_norm_eps": 1e-6,
        "sliding_window": 1024,
        "layer_types": ["full_attention" if i % 6 == 5 else "sliding_attention" for i in range(layers)],
        "rope_parameters": {
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1000000.0},
        },
        "final_logit_softcapping": 30.0,
        "hidden_size_per_layer_input": 0,
        "tie_word_embeddings": True,
        "pad_token_id": 0,
        "eos_token_id": 106,
        "bos_token_id": 2,
        "dtype": "bfloat16",
    }


def gemma4_layer_shapes(c: dict, i: int) -> dict[str, tuple[int, ...]]:
    H, inter, heads = c["hidden_size"], c["intermediate_size"], c["num_attention_heads"]
    full = c["layer_types"][i] == "full_attention"
    d = c["global_head_dim"] if full else c["head_dim"]
    kvh = c["num_global_key_value_heads"] if full else c["num_key_value_heads"]
    p = f"model.layers.{i}."
    shapes = {
        "self_attn.q_proj.weight": (heads * d, H),
        "self_attn.k_proj.weight": (kvh * d, H),
        "self_attn.o_proj.weight": (H, heads * d),
        "self_attn.q_norm.weight": (d,),
        "self_attn.k_norm.weight": (d,),
        "mlp.gate_proj.weight": (inter, H),
        "mlp.up_proj.weight": (inter, H),
        "mlp.down_proj.weight": (H, inter),
        "layer_scalar": (1,),
    }
    if not full:  # a global layer's values are its keys' projection
        shapes["self_attn.v_proj.weight"] = (kvh * d, H)
    for norm in ("input", "post_attention", "pre_feedforward", "post_feedforward"):
        shapes[f"{norm}_layernorm.weight"] = (H,)
    return {p + k: v for k, v in shapes.items()}


GEMMA4_SPECIAL = {"<pad>": 0, "<eos>": 1, "<bos>": 2, "<mask>": 4, "<start_of_turn>": 105, "<end_of_turn>": 106}

# name -> (target config, special tokens, draft: layers, intermediate, block, mask id, target_layer_ids)
PAIRS = {
    "qwen3-0.6b": (_qwen3(1024, 28, 16, 3072, True), QWEN3_SPECIAL, 5, 3072, 16, 151669, [1, 7, 13, 19, 25]),
    "qwen3-4b": (_qwen3(2560, 36, 32, 9728, True), QWEN3_SPECIAL, 5, 9728, 16, 151669, [1, 9, 17, 25, 33]),
    "qwen3-8b": (_qwen3(4096, 36, 32, 12288, False), QWEN3_SPECIAL, 5, 12288, 16, 151669, [1, 9, 17, 25, 33]),
    "llama3.1-8b": (LLAMA31_8B, LLAMA_SPECIAL, 5, 14336, 16, 128002, [1, 8, 15, 22, 29]),
    "qwen3.5-9b": (_qwen3_5(4096, 12288, False), QWEN35_SPECIAL, 5, 12288, 16, 248070, [1, 8, 15, 22, 29]),
    "qwen3.5-4b": (_qwen3_5(2560, 9216, True), QWEN35_SPECIAL, 5, 9216, 16, 248070, [1, 8, 15, 22, 29]),
    # 8 layers of Qwen3.5-9B (6 Gated DeltaNet, 2 full attention) and of Qwen3-8B: per-call costs and peers
    # side by side in this machine's memory and disk
    "qwen3-8b-8l": (_qwen3(4096, 8, 32, 12288, False), QWEN3_SPECIAL, 5, 12288, 16, 151669, [1, 2, 3, 4, 5]),
    "qwen3.5-9b-8l": (_qwen3_5(4096, 12288, False, 8), QWEN35_SPECIAL, 5, 12288, 16, 248070, [1, 2, 3, 4, 5]),
    # and 4 (3 Gated DeltaNet, 1 full attention): the difference is what 4 layers cost, for projecting to 32
    "qwen3.5-9b-4l": (_qwen3_5(4096, 12288, False, 4), QWEN35_SPECIAL, 5, 12288, 16, 248070, [0, 1, 2, 3]),
    # 4 of Qwen3-Coder-30B-A3B's 48 layers at their real widths (the whole is 61 GB of bf16, more than this disk)
    "qwen3-coder-30b-a3b-4l": (_qwen3_moe(4), QWEN3_SPECIAL, 5, 6144, 16, 151669, [0, 1, 2, 3]),
    # gpt-oss-20b whole (an int8/int4 build's export stores no weights), and 4 of its 24 layers
    "gpt-oss-20b": (_gpt_oss(24), GPT_OSS_SPECIAL, 5, 5760, 16, 200000, [1, 6, 11, 16, 21]),
    "gpt-oss-20b-4l": (_gpt_oss(4), GPT_OSS_SPECIAL, 5, 5760, 16, 200000, [0, 1, 2, 3]),
    # and 2: the difference of the two slices is what 2 more layers cost (projected to 24 by peers and dflash)
    "gpt-oss-20b-2l": (_gpt_oss(2), GPT_OSS_SPECIAL, 5, 5760, 16, 200000, [0, 1]),
    "qwen3-vl-8b": (_qwen3_vl_8b(), QWEN3_VL_SPECIAL, 5, 12288, 16, 151669, [1, 9, 17, 25, 33]),
    # 12 of Gemma 4 31B's 60 layers (10 window, 2 global) at their real widths (the whole is 62 GB of bf16)
    "gemma-4-31b-12l": (_gemma4_31b(12), GEMMA4_SPECIAL, 5, 21504, 16, 4, [1, 3, 5, 7, 9]),
    # and 2: the per-layer cost is the difference, for projecting the 48-layer model
    "qwen3-coder-30b-a3b-2l": (_qwen3_moe(2), QWEN3_SPECIAL, 5, 6144, 16, 151669, [0, 1, 1, 1]),
}


def layer_shapes(c: dict, prefix: str, qk_norm: bool) -> dict[str, tuple[int, ...]]:
    """One decoder layer's tensors (Hugging Face names under `prefix`)."""
    H, inter, d = c["hidden_size"], c["intermediate_size"], c["head_dim"]
    q, kv = c["num_attention_heads"] * d, c["num_key_value_heads"] * d
    shapes = {
        "input_layernorm.weight": (H,),
        "self_attn.q_proj.weight": (q, H),
        "self_attn.k_proj.weight": (kv, H),
        "self_attn.v_proj.weight": (kv, H),
        "self_attn.o_proj.weight": (H, q),
        "post_attention_layernorm.weight": (H,),
        "mlp.gate_proj.weight": (inter, H),
        "mlp.up_proj.weight": (inter, H),
        "mlp.down_proj.weight": (H, inter),
    }
    if qk_norm:
        shapes.update({"self_attn.q_norm.weight": (d,), "self_attn.k_norm.weight": (d,)})
    return {prefix + k: v for k, v in shapes.items()}


def expert_shapes(c: dict, prefix: str) -> dict[str, tuple[int, ...]]:
    """A sparse MLP in place of the dense one: the router and one tensor per expert and projection."""
    H, inter, n = c["hidden_size"], c["moe_intermediate_size"], c["num_experts"]
    shapes = {prefix + "mlp.gate.weight": (n, H)}
    for e in range(n):
        p = f"{prefix}mlp.experts.{e}."
        shapes |= {p + "gate_proj.weight": (inter, H), p + "up_proj.weight": (inter, H)}
        shapes[p + "down_proj.weight"] = (H, inter)
    return shapes


def linear_layer_shapes(c: dict, prefix: str) -> dict[str, tuple[int, ...]]:
    """A Gated DeltaNet decoder layer's tensors (Qwen3.5)."""
    H, inter = c["hidden_size"], c["intermediate_size"]
    key = c["linear_num_key_heads"] * c["linear_key_head_dim"]
    value, hv = c["linear_num_value_heads"] * c["linear_value_head_dim"], c["linear_num_value_heads"]
    conv = 2 * key + value
    shapes = {
        "input_layernorm.weight": (H,),
        "linear_attn.in_proj_qkv.weight": (conv, H),
        "linear_attn.in_proj_z.weight": (value, H),
        "linear_attn.in_proj_b.weight": (hv, H),
        "linear_attn.in_proj_a.weight": (hv, H),
        "linear_attn.conv1d.weight": (conv, 1, c["linear_conv_kernel_dim"]),
        "linear_attn.dt_bias": (hv,),
        "linear_attn.A_log": (hv,),
        "linear_attn.norm.weight": (c["linear_value_head_dim"],),
        "linear_attn.out_proj.weight": (H, value),
        "post_attention_layernorm.weight": (H,),
        "mlp.gate_proj.weight": (inter, H),
        "mlp.up_proj.weight": (inter, H),
        "mlp.down_proj.weight": (H, inter),
    }
    return {prefix + k: v for k, v in shapes.items()}


def qwen3_5_shapes(top: dict) -> dict[str, tuple[int, ...]]:
    """The multimodal layout: the language model under model.language_model.*, a stand-in of the vision
    tower (a few of its tensors: convert must leave them alone) and the multi-token-prediction head's norm."""
    c = top["text_config"]
    H, V, p = c["hidden_size"], c["vocab_size"], "model.language_model."
    shapes = {p + "embed_tokens.weight": (V, H)}
    for i, kind in enumerate(c["layer_types"]):
        if kind == "linear_attention":
            shapes.update(linear_layer_shapes(c, f"{p}layers.{i}."))
        else:
            attn = layer_shapes(c, f"{p}layers.{i}.", True)
            q = f"{p}layers.{i}.self_attn.q_proj.weight"
            attn[q] = (2 * attn[q][0], H)  # the query and its output gate
            shapes.update(attn)
    shapes[p + "norm.weight"] = (H,)
    if not c["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (V, H)
    # No vision tower (convert then builds the text path; a part of one would be a truncated checkpoint); an MTP
    # tensor, which convert leaves out.
    shapes |= {"mtp.norm.weight": (H,)}
    return shapes


def qwen3_vl_shapes(top: dict) -> dict[str, tuple[int, ...]]:
    """Qwen3-VL's layout: the Qwen3 language model under model.language_model.*, the whole vision tower
    under model.visual.* (its shapes from Hugging Face's own module, built on the meta device)."""
    from transformers import AutoModel, Qwen3VLVisionConfig

    c = top["text_config"]
    H, V, p = c["hidden_size"], c["vocab_size"], "model.language_model."
    shapes = {p + "embed_tokens.weight": (V, H), p + "norm.weight": (H,), "lm_head.weight": (V, H)}
    for i in range(c["num_hidden_layers"]):
        shapes.update(layer_shapes(c, f"{p}layers.{i}.", True))
    with torch.device("meta"):
        tower = AutoModel.from_config(Qwen3VLVisionConfig(**top["vision_config"]))
    return shapes | {"model.visual." + n: tuple(t.shape) for n, t in tower.named_parameters()}


def target_shapes(c: dict) -> dict[str, tuple[int, ...]]:
    if c.get("model_type") == "qwen3_vl":
        return qwen3_vl_shapes(c)
    if "text_config" in c:
        return qwen3_5_shapes(c)
    H, V = c["hidden_size"], c["vocab_size"]
    shapes = {"model.embed_tokens.weight": (V, H)}
    for i in range(c["num_hidden_layers"]):
        if c["model_type"] == "gpt_oss":
            shapes.update(gpt_oss_layer_shapes(c, f"model.layers.{i}."))
            continue
        if c["model_type"] == "gemma4_text":
            shapes.update(gemma4_layer_shapes(c, i))
            continue
        layer = layer_shapes(c, f"model.layers.{i}.", c["model_type"] in ("qwen3", "qwen3_moe"))
        if c["model_type"] == "qwen3_moe":  # every layer sparse (decoder_sparse_step 1, no mlp_only_layers)
            layer = {k: v for k, v in layer.items() if ".mlp." not in k} | expert_shapes(c, f"model.layers.{i}.")
        shapes.update(layer)
    shapes["model.norm.weight"] = (H,)
    if not c["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (V, H)
    return shapes


def draft_shapes(c: dict, n_features: int) -> dict[str, tuple[int, ...]]:
    """z-lab draft layout: Qwen3-style layers without the `model.` prefix, plus fc and the two norms."""
    H = c["hidden_size"]
    shapes = {"fc.weight": (H, n_features * H), "hidden_norm.weight": (H,), "norm.weight": (H,)}
    for i in range(c["num_hidden_layers"]):
        shapes.update(layer_shapes(c, f"layers.{i}.", True))
    return shapes


def write_sharded(shapes: dict[str, tuple[int, ...]], out: Path, seed: int, unit_scale_attention: bool = False) -> int:
    """Random bf16 tensors (norm weights 1) in ~2 GB shards plus the Hugging Face shard index.

    `unit_scale_attention` (Gemma 4: q and k RMS-normalised, scores not divided by sqrt(d)): q_norm / k_norm
    weights d^-1/4, so random scores have unit spread as in a trained model; with weights 1 they would spread
    by sqrt(d) = 16-23 and every softmax would be a near one-hot that any rounding flips."""
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(seed)
    groups, current, size = [], [], 0
    for name, shape in shapes.items():
        n = 2
        for d in shape:
            n *= d
        if current and size + n > SHARD_BYTES:
            groups.append(current)
            current, size = [], 0
        current.append(name)
        size += n
    groups.append(current)
    weight_map, total = {}, 0
    for k, names in enumerate(groups):
        fname = f"model-{k + 1:05d}-of-{len(groups):05d}.safetensors"
        shard = {}
        for name in names:
            shape = shapes[name]
            if name.endswith("_blocks"):  # MXFP4: two random 4-bit codes a byte
                shard[name] = torch.randint(0, 256, shape, generator=gen, dtype=torch.uint8)
            elif name.endswith("_scales"):  # E8M0 exponents: 2^-7, so values up to 6/128 like a trained layer's
                shard[name] = torch.full(shape, 120, dtype=torch.uint8)
            elif name.endswith(("A_log", "dt_bias")):  # trained values sit near these
                shard[name] = torch.full(shape, 0.5 if name.endswith("A_log") else 1.0, dtype=torch.bfloat16)
            elif unit_scale_attention and name.endswith(("self_attn.q_norm.weight", "self_attn.k_norm.weight")):
                shard[name] = torch.full(shape, shape[0] ** -0.25, dtype=torch.bfloat16)
            elif len(shape) == 1:
                shard[name] = torch.ones(shape, dtype=torch.bfloat16)
            else:
                shard[name] = (torch.randn(shape, generator=gen) * 0.02).to(torch.bfloat16)
            weight_map[name] = fname
            total += shard[name].numel() * shard[name].element_size()
        save_file(shard, str(out / fname), metadata={"format": "pt"})
        del shard
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    return total


def write_tokenizer(out: Path, vocab_size: int, special: dict[str, int]) -> None:
    """Byte-level BPE without merges: every byte is a token (any text encodes), every id decodes."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    by_id = {i: t for t, i in special.items()}
    for i in range(len(vocab), vocab_size):
        vocab[by_id.get(i, f"<filler_{i}>")] = i
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    names = list(special)
    # what chat models stop on (gpt-oss: the end of a harmony reply)
    eos = next(t for t in ("<|im_end|>", "<end_of_turn>", "<|eot_id|>", "<|return|>") if t in special)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=eos, bos_token=names[0], pad_token=names[0])
    fast.add_special_tokens({"additional_special_tokens": names})
    fast.save_pretrained(str(out))


def make_pair(name: str, root: Path, seed: int = 0) -> tuple[Path, Path]:
    top_cfg, special, d_layers, d_inter, block, mask, ids = PAIRS[name]
    target_cfg = top_cfg.get("text_config", top_cfg)  # the draft copies the language model's shapes
    root = root / name
    target, draft = root / "target", root / "draft"
    if (root / "done").exists():
        return target, draft
    t0 = time.time()
    target.mkdir(parents=True, exist_ok=True)
    draft.mkdir(parents=True, exist_ok=True)
    (target / "config.json").write_text(json.dumps(top_cfg, indent=2))
    eos = target_cfg["eos_token_id"]
    (target / "generation_config.json").write_text(
        json.dumps({"bos_token_id": target_cfg["bos_token_id"], "eos_token_id": eos})
    )
    write_tokenizer(target, target_cfg["vocab_size"], special)
    if top_cfg.get("model_type") == "qwen3_vl":
        (target / "preprocessor_config.json").write_text(json.dumps(QWEN3_VL_PREPROCESSOR, indent=2))
    tbytes = write_sharded(target_shapes(top_cfg), target, seed, top_cfg.get("model_type") == "gemma4_text")
    draft_cfg = {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "hidden_size": target_cfg["hidden_size"],
        "num_hidden_layers": d_layers,
        "num_attention_heads": target_cfg["num_attention_heads"],
        "num_key_value_heads": target_cfg["num_key_value_heads"],
        "head_dim": target_cfg["head_dim"],
        "intermediate_size": d_inter,
        "vocab_size": target_cfg["vocab_size"],
        "max_position_embeddings": target_cfg["max_position_embeddings"],
        "rms_norm_eps": target_cfg["rms_norm_eps"],
        "rope_theta": target_cfg.get("rope_theta") or _rope_theta(target_cfg["rope_parameters"]),
        "attention_bias": False,
        "tie_word_embeddings": False,
        "block_size": block,
        "num_target_layers": target_cfg["num_hidden_layers"],
        "dflash_config": {"mask_token_id": mask, "target_layer_ids": ids},
        "torch_dtype": "bfloat16",
    }
    (draft / "config.json").write_text(json.dumps(draft_cfg, indent=2))
    dbytes = write_sharded(draft_shapes(draft_cfg, len(ids)), draft, seed + 1)
    (root / "done").write_text(json.dumps({"target_bytes": tbytes, "draft_bytes": dbytes, "seconds": time.time() - t0}))
    return target, draft


def _rope_theta(params: dict) -> float:
    """The draft's RoPE base: the target's, or (a RoPE per layer kind: Gemma 4) its window layers'."""
    return params.get("rope_theta") or params["sliding_attention"]["rope_theta"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("pair", choices=sorted(PAIRS))
    ap.add_argument("root", type=Path)
    args = ap.parse_args()
    target, draft = make_pair(args.pair, args.root)
    print(json.dumps({"target": str(target), "draft": str(draft)}))


if __name__ == "__main__":
    main()
