"""The Family record: what one target family declares, so code elsewhere reads a trait, never tests a name.

A trait is named for what it means (`moe`, `thinking_switch`), not for the family that has it; a family module
(qwen3.py, gemma4.py, ...) sets the ones it has and leaves the rest at their defaults.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Family:
    model_type: str
    qk_norm: bool  # Qwen3 normalises q and k per head before RoPE; Llama does not
    default_mask_token_id: int | None  # the published drafts' mask id, when the draft config lacks one
    # Hugging Face model_types of this family's checkpoints (the multimodal layout and the text-only one)
    model_types: tuple[str, ...] = ()

    # --- layers ---------------------------------------------------------------------------------------
    # Linear-attention layers between full-attention ones (modeling/hybrid_target.py), not StaticCacheTarget
    hybrid: bool = False
    # Sparse mixture-of-experts MLPs (modeling/moe.py) in the layers modeling.moe.sparse_layers names
    moe: bool = False
    # Sliding-window attention layers (config `layer_types`), computed with their window
    sliding: bool = False
    # Attention geometry (head width, KV heads) differs by layer kind (config `per_layer_config`): a target
    # module of its own (modeling/gemma4_target.py), whose limits convert checks; TargetSpec holds layer 0's
    per_layer_geometry: bool = False
    # The target multiplies its token embedding by a scale (modeling/gemma4_target.embed_scale); the draft,
    # embedding its block through the target's embedding, is given the same scale by convert
    scaled_embedding: bool = False
    # A learnt logit per attention head that joins the softmax with no value (modeling/target.py)
    attention_sinks: bool = False
    # Every layer's experts fused in one tensor pair with biases, stored transposed ([E, in, out], or MXFP4
    # blocks), gate and up interleaved; a biased router, a clamped gated activation (modeling/moe.GptOssMoe).
    # Without it: one tensor per expert and projection, sparse layers by Hugging Face's rule (Qwen's MoE).
    fused_experts: bool = False
    # Tensors the modules read in another layout than the checkpoint stores (Qwen3-Next's Gated DeltaNet
    # projections, fused per key head, read as Qwen3.5's four): convert calls it with the target's config.json and
    # weights (a WeightStore) for weights.Stack views by name, so no byte is copied...
    checkpoint_views: Callable[[dict[str, Any], Any], dict[str, Any]] | None = None
    # ... and the export's check against Hugging Face's own model (modeling/moe.to_hf_state) calls this with the
    # module's tensors (a state dict) and the Hugging Face config: the same tensors in the checkpoint's layout
    hf_state: Callable[[dict[str, Any], Any], dict[str, Any]] | None = None

    # --- images ---------------------------------------------------------------------------------------
    # Images in, where the checkpoint has a vision tower: its graph and a language model taking its features
    # (modeling/vl_target.py, gemma4_target.py, hybrid_target.py); a QAIC build keeps the text path only
    vision: bool = False
    # The tower pools patches per window and an embedder projects them (modeling/vision_gemma4.py): a prompt's
    # image is boi, one token per soft token, eoi, with plain positions. Without it the tower merges
    # neighbouring patches (modeling/vision_qwen3_vl.py), one token per merged group, with M-RoPE positions.
    pooled_vision: bool = False
    # "module.Class" of Hugging Face's multimodal model whose get_rope_index gives a prompt's M-RoPE positions
    mrope_model: str | None = None

    # --- chat template --------------------------------------------------------------------------------
    # The template takes `enable_thinking` (run.enable_thinking; a chat request may set it per request)
    thinking_switch: bool = False
    # The template (harmony) takes `reasoning_effort` for its system line (run.reasoning_effort)
    reasoning_effort: bool = False
    # How the model writes tool calls, which serve constrains and parses (serve/tool_formats.py): "hermes" or
    # "qwen3_xml"; None: serve refuses `tools` for this family
    tool_call_format: str | None = None

    # --- QAIC (Qualcomm Cloud AI 100) -----------------------------------------------------------------
    # Its programs may hold several sequences' caches (compile.qaic.full_batch_size): every layer keeps only
    # K/V (no recurrent state), no image inputs ride along. Mixture-of-experts rows gather their own experts
    # (modeling/moe_gathered.py), so sharing a call changes no sequence's outputs.
    qaic_slot_cache: bool = False
    # A QAIC build keeps the vision path (the bundle's third program); other vision families build text only
    qaic_vision: bool = False
    # Why compile.backend=qaic refuses this family, before anything is built (None: QAIC takes it)
    qaic_refusal: str | None = None
