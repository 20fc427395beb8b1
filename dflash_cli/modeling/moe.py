"""Sparse mixture-of-experts MLPs (Qwen3-MoE, Qwen3.5-MoE, gpt-oss), exported as ONNX Runtime's `com.microsoft.MoE`.

The router (a Linear to one logit per expert) stays an ordinary MatMul. The experts are one custom op,
`dflash::moe`: in PyTorch it computes exactly what Hugging Face's blocks do (softmax over the experts,
top-k, optionally renormalised, the gated activation per chosen expert, weighted sum); in the exported
graph it routes itself and hands ONNX Runtime's MoE node one row per (token, chosen expert), so only the
chosen experts are computed and a token's output depends only on its own row (see `translate`): a verify
block gives each position what a one-token call gives it (checked at build time, ortcompile/checks.py).

Weights: `gate_up_proj` [experts, 2*inter, hidden] with gate and up rows interleaved (the layout ONNX
Runtime's CPU kernel takes), `down_proj` [experts, hidden, inter]. Checkpoints store them otherwise (one
tensor per expert and projection; gpt-oss transposed, or MXFP4); convert indexes a stacked view of them
(checkpoints/weights.py, `Stack`), so nothing is copied."""

from __future__ import annotations

import torch
from torch import nn

from dflash_cli.families import traits_of

DOMAIN = "com.microsoft"


@torch.library.custom_op("dflash::moe", mutates_args=())
def moe(
    x: torch.Tensor,
    logits: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    gate_up_bias: torch.Tensor | None,
    down_bias: torch.Tensor | None,
    k: int,
    renormalize: bool,
    act: list[float],
) -> torch.Tensor:
    """x [tokens, hidden], logits [..., experts] (one row per token; the router's Linear runs on the 3-D hidden
    states, where it exports as MatMul, not as the Gemm a 2-D input gives, which is not on the QAIC op list; it is
    flattened here by the token count, as the export would fix the expert count as a constant and validation's
    reduced model has fewer experts) -> [tokens, hidden]. `act` = (alpha, beta, limit) of the
    gated activation min(g, limit) * sigmoid(alpha * min(g, limit)) * (clamp(u, -limit, limit) + beta): SiLU
    gating is (1, 0, inf); gpt-oss's is (1.702, 1, 7)."""
    alpha, beta, limit = act
    probs = torch.softmax(logits.reshape(x.shape[0], -1).float(), dim=-1)
    weights, chosen = torch.topk(probs, k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    weights = weights.to(x.dtype)
    out = torch.zeros_like(x)
    for slot in range(k):  # one expert per token at a time: a gather of [tokens, 2*inter, hidden], not k of them
        e = chosen[:, slot]
        gu = torch.bmm(gate_up[e], x[:, :, None])[..., 0]
        if gate_up_bias is not None:
            gu = gu + gate_up_bias[e]
        g, u = gu[:, 0::2].clamp(max=limit), gu[:, 1::2].clamp(min=-limit, max=limit)
        y = torch.bmm(down[e], (g * torch.sigmoid(alpha * g) * (u + beta))[:, :, None])[..., 0]
        if down_bias is not None:
            y = y + down_bias[e]
        out = out + weights[:, slot, None] * y
    return out


@moe.register_fake
def _(x, logits, gate_up, down, gate_up_bias, down_bias, k, renormalize, act):
    return torch.empty_like(x)


SILU_GATE = [1.0, 0.0, float("inf")]  # Qwen's experts: silu(g) * u


def _register_schema() -> None:
    """ONNX has no schema for ONNX Runtime's contrib ops; the exporter's builder needs one to emit the node."""
    import onnx
    from onnx.defs import OpSchema

    try:
        onnx.defs.get_schema("MoE", 1, DOMAIN)
        return
    except onnx.defs.SchemaError:
        pass
    param, opt = OpSchema.FormalParameter, OpSchema.FormalParameterOption
    attr, kind = OpSchema.Attribute, OpSchema.AttrType
    inputs = [
        param("input", "T"),
        param("router_probs", "T"),
        param("fc1_experts_weights", "T"),
        param("fc1_experts_bias", "T", param_option=opt.Optional),
        param("fc2_experts_weights", "T"),
        param("fc2_experts_bias", "T", param_option=opt.Optional),
    ]
    attrs = [
        attr("k", kind.INT, ""),
        attr("activation_type", kind.STRING, ""),
        attr("normalize_routing_weights", kind.INT, ""),
        attr("swiglu_fusion", kind.INT, ""),
        attr("activation_alpha", kind.FLOAT, ""),
        attr("activation_beta", kind.FLOAT, ""),
        attr("swiglu_limit", kind.FLOAT, ""),
    ]
    schema = OpSchema(
        "MoE",
        DOMAIN,
        1,
        inputs=inputs,
        outputs=[param("output", "T")],
        type_constraints=[("T", ["tensor(float)", "tensor(float16)"], "")],
        attributes=attrs,
    )
    onnx.defs.register_schema(schema)


def onnx_translations() -> dict:
    """The exporter's table entry: `dflash::moe` -> com.microsoft.MoE (SwiGLU, gate/up interleaved)."""
    import onnxscript
    from onnxscript import opset18 as op

    _register_schema()
    ms = onnxscript.values.Opset(DOMAIN, 1)

    def translate(x, logits, gate_up, down, gate_up_bias, down_bias, k: int, renormalize: bool, act: list[float]):
        # ONNX Runtime's kernels sum a token's k expert outputs in an order that depends on the other tokens
        # of the call (per-thread partial sums over experts; measured with 128 experts, 8 per token), and
        # take another path for an expert that got a single row than for one that got several. So the
        # routing runs here, each (token, slot) becomes a row of its own that goes to exactly one expert
        # (k=1: nothing for the kernel to sum), every row is given twice (every chosen expert then has
        # at least two), and the k outputs are weighted and summed here, in slot order. A token's output
        # is then the same whatever shares its call (checked at build time, ortcompile/checks.py).
        probs = op.Softmax(by_token(x, logits), axis=-1)
        top, _ = op.TopK(probs, op.Constant(value_ints=[k]), axis=-1)
        weights = op.Div(top, op.ReduceSum(top, op.Constant(value_ints=[-1]), keepdims=1)) if renormalize else top
        tokens, width = op.Shape(x, start=0, end=1), op.Shape(x, start=1, end=2)
        slots = op.Constant(value_ints=[k])
        # row (token, slot) for every token and slot, token-major: its token's index, k times over
        token_of_row = op.Reshape(
            op.Expand(
                op.Unsqueeze(op.Range(op.Constant(value_int=0), op.Squeeze(tokens), op.Constant(value_int=1)), [1]),
                op.Concat(tokens, slots, axis=0),
            ),
            op.Constant(value_ints=[-1]),
        )
        rows = op.Gather(x, token_of_row, axis=0)
        # Row (token, slot) goes to the slot's expert: its logit 0, every other -1 (the top-1 weight is then
        # exactly 1). Found by value, not index, and gathered rather than reshaped, so no shape here depends
        # on the number of experts (the export folds such shapes to constants, and validation's reduced
        # model has fewer experts).
        chosen = op.Equal(op.Gather(probs, token_of_row, axis=0), op.Reshape(top, op.Constant(value_ints=[-1, 1])))
        on, off = op.CastLike(op.Constant(value_float=0.0), x), op.CastLike(op.Constant(value_float=-1.0), x)
        one_hot = op.Where(chosen, on, off)  # in the graph's float type (an fp16 export too)
        alpha, beta, limit = act
        limits = {"swiglu_limit": limit} if limit != float("inf") else {}
        y = ms.MoE(
            op.Concat(rows, rows, axis=0),
            op.Concat(one_hot, one_hot, axis=0),
            gate_up,
            gate_up_bias,
            down,
            down_bias,
            k=1,
            activation_type="swiglu",
            normalize_routing_weights=1,
            swiglu_fusion=1,
            activation_alpha=alpha,
            activation_beta=beta,
            **limits,
        )
        first, _ = op.Split(y, axis=0, num_outputs=2)
        per_slot = op.Mul(
            op.Reshape(first, op.Concat(tokens, slots, width, axis=0)),
            op.Unsqueeze(weights, op.Constant(value_ints=[-1])),
        )
        parts = op.Split(per_slot, axis=1, num_outputs=k) if k > 1 else (per_slot,)
        total = parts[0]
        for part in parts[1:]:
            total = op.Add(total, part)
        return op.Squeeze(total, op.Constant(value_ints=[1]))

    return {torch.ops.dflash.moe.default: translate}


def by_token(x, logits):
    """The router's logits [tokens, experts] in a translation, reshaped by the token count of x (see `moe`)."""
    from onnxscript import opset18 as op

    return op.Reshape(logits, op.Concat(op.Shape(x, start=0, end=1), op.Constant(value_ints=[-1]), axis=0))


def to_hf_state(state: dict, cfg) -> dict:
    """Our tensors under Hugging Face's layout (`cfg` its config): transformers 5 fuses Qwen's gate and up as
    [gate | up], not interleaved; gpt-oss keeps them interleaved, both expert weights transposed; tensors convert
    read in another layout than the checkpoint's are put back (Family.hf_state)."""
    family = traits_of(cfg.model_type)
    fused = family.fused_experts
    out = dict(state)
    for k, v in state.items():
        if fused and k.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj")):
            out[k] = v.transpose(1, 2)
        elif k.endswith("mlp.experts.gate_up_proj"):
            e, rows, cols = v.shape
            out[k] = v.view(e, rows // 2, 2, cols).transpose(1, 2).reshape(e, rows, cols)
    return out if family.hf_state is None else family.hf_state(out, cfg)


class Router(nn.Module):
    def __init__(self, hidden: int, experts: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(experts, hidden))


class Experts(nn.Module):
    def __init__(self, hidden: int, inter: int, experts: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(experts, 2 * inter, hidden))
        self.down_proj = nn.Parameter(torch.empty(experts, hidden, inter))


class SparseMoe(nn.Module):
    """Module names mirror Hugging Face's (`mlp.gate.weight`, `mlp.experts.*`, `mlp.shared_expert*`)."""

    def __init__(self, hidden: int, inter: int, experts: int, top_k: int, renormalize: bool, shared: int = 0) -> None:
        super().__init__()
        self.gate = Router(hidden, experts)
        self.experts = Experts(hidden, inter, experts)
        self.top_k, self.renormalize = top_k, renormalize
        if shared:  # Qwen3.5-MoE: an always-on expert, scaled by a sigmoid gate of its own
            from dflash_cli.modeling.layers import SwiGLU

            self.shared_expert = SwiGLU(hidden, shared)
            self.shared_expert_gate = nn.Linear(hidden, 1, bias=False)

    @classmethod
    def from_hf(cls, cfg) -> SparseMoe:
        renormalize = bool(getattr(cfg, "norm_topk_prob", True))  # Qwen3.5-MoE always renormalises
        shared = int(getattr(cfg, "shared_expert_intermediate_size", 0) or 0)
        return cls(
            cfg.hidden_size, cfg.moe_intermediate_size, num_experts(cfg), cfg.num_experts_per_tok, renormalize, shared
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        logits = nn.functional.linear(x, self.gate.weight)  # on 3-D: MatMul (`moe`'s docstring)
        experts = self.experts
        out = torch.ops.dflash.moe(
            flat, logits, experts.gate_up_proj, experts.down_proj, None, None, self.top_k, self.renormalize, SILU_GATE
        )
        out = out.reshape(x.shape)
        if hasattr(self, "shared_expert"):  # on the 3-D input, as the router (`moe`'s docstring)
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out


class GptOssExperts(nn.Module):
    """gpt-oss's experts with their biases; stored in Hugging Face's layout transposed ([E, hidden, 2*inter],
    gate and up interleaved), held here as ONNX Runtime takes them ([E, 2*inter, hidden]: weights.Stack)."""

    def __init__(self, hidden: int, inter: int, experts: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(experts, 2 * inter, hidden))
        self.gate_up_proj_bias = nn.Parameter(torch.empty(experts, 2 * inter))
        self.down_proj = nn.Parameter(torch.empty(experts, hidden, inter))
        self.down_proj_bias = nn.Parameter(torch.empty(experts, hidden))


class GptOssRouter(nn.Module):
    def __init__(self, hidden: int, experts: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(experts, hidden))
        self.bias = nn.Parameter(torch.empty(experts))


class GptOssMoe(nn.Module):
    """gpt-oss's MLP (`mlp.router.*`, `mlp.experts.*`): softmax over the top-k router logits (the same weights
    as the softmax over all, renormalised over the top k), clamped gated activation, biases."""

    def __init__(self, hidden: int, inter: int, experts: int, top_k: int, alpha: float, limit: float) -> None:
        super().__init__()
        self.router = GptOssRouter(hidden, experts)
        self.experts = GptOssExperts(hidden, inter, experts)
        self.top_k = top_k
        self.act = [float(alpha), 1.0, float(limit)]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        logits = nn.functional.linear(x, self.router.weight, self.router.bias)
        e = self.experts
        out = torch.ops.dflash.moe(
            flat, logits, e.gate_up_proj, e.down_proj, e.gate_up_proj_bias, e.down_proj_bias, self.top_k, True, self.act
        )
        return out.reshape(x.shape)


def num_experts(cfg) -> int:
    """Transformers 5 saves Qwen3-MoE's `num_experts` as `num_local_experts` (an attribute map); published
    configs say `num_experts`."""
    if not isinstance(cfg, dict):
        return int(getattr(cfg, "num_experts", 0) or 0)
    return int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0)


def sparse_layers(cfg) -> list[int]:
    """Indices of the layers whose MLP is the sparse block (Hugging Face's rule for Qwen3-MoE; every layer of
    gpt-oss); `cfg` a config object or its dict."""
    get = cfg.get if isinstance(cfg, dict) else lambda k, d=None: getattr(cfg, k, d)
    if traits_of(get("model_type")).fused_experts:
        return list(range(int(get("num_hidden_layers"))))
    experts, step = num_experts(cfg), int(get("decoder_sparse_step", 1) or 1)
    dense = set(get("mlp_only_layers", None) or [])
    return [i for i in range(int(get("num_hidden_layers"))) if experts > 0 and i not in dense and (i + 1) % step == 0]


def checkpoint_stacks(cfg: dict, store) -> dict:
    """weights.Stack per stacked expert tensor of a MoE checkpoint: Qwen's per-expert keys, as published, or
    gpt-oss's fused tensors in Hugging Face's transposed layout."""
    from dflash_cli.checkpoints.weights import Stack
    from dflash_cli.errors import CheckpointError

    if traits_of(cfg.get("model_type")).fused_experts:
        return _gpt_oss_stacks(cfg, store)

    experts = num_experts(cfg)
    out = {}
    for layer in sparse_layers(cfg):
        prefix = f"model.layers.{layer}."
        for name, (parts, interleave) in _expert_parts(prefix, experts).items():
            missing = [p for p in parts if p not in store]
            if missing:
                raise CheckpointError(
                    f"target layer {layer} lacks expert weights ({len(missing)} missing, e.g. {missing[0]})",
                    hint="the checkpoint is incomplete or not a Qwen3-MoE checkpoint with one tensor per expert",
                )
            shapes = {tuple(store.shape(p)) for p in parts}
            if len(shapes) != 1:
                raise CheckpointError(
                    f"target layer {layer}: expert tensors of {name} differ in shape ({sorted(shapes)[:2]})",
                    hint="the checkpoint is corrupt",
                )
            out[name] = Stack(parts, interleave)
    return out


def _gpt_oss_stacks(cfg: dict, store) -> dict:
    from dflash_cli.checkpoints.weights import Stack
    from dflash_cli.errors import CheckpointError

    out = {}
    for layer in range(int(cfg["num_hidden_layers"])):
        for w in ("gate_up_proj", "down_proj"):
            name = f"model.layers.{layer}.mlp.experts.{w}"
            blocks, scales = f"{name}_blocks", f"{name}_scales"
            if blocks in store and scales in store:  # MXFP4, as published: already [E, out, in]
                out[name] = Stack((blocks, scales), kind="mxfp4")
            elif name in store and len(store.shape(name)) == 3:  # bf16 as transformers saves it: [E, in, out]
                out[name] = Stack((name,), kind="transpose")
            else:
                raise CheckpointError(
                    f"target layer {layer} has no {w} expert tensor ({name}, or its MXFP4 _blocks and _scales)",
                    hint="the checkpoint is incomplete or not a gpt-oss checkpoint",
                )
    return out


def _expert_parts(prefix: str, experts: int) -> dict[str, tuple[tuple[str, ...], int]]:
    """Stacked name -> (the checkpoint's per-expert keys, interleave). Interleave 2: (gate, up) pairs whose
    rows alternate in the stacked expert (ONNX Runtime's fused SwiGLU layout); 1: one part per expert."""
    e = f"{prefix}mlp.experts."
    return {
        e + "gate_up_proj": (tuple(f"{e}{i}.{w}_proj.weight" for i in range(experts) for w in ("gate", "up")), 2),
        e + "down_proj": (tuple(f"{e}{i}.down_proj.weight" for i in range(experts)), 1),
    }
