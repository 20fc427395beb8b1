"""A plain, eager PyTorch DFlash (REFERENCE sections 1-3) written independently of dflash_cli.

No caches, no static shapes: every step recomputes the target over the whole sequence and runs the
draft from its raw z-lab state dict. Used to check the toolchain's per-step draft tokens and
acceptance lengths.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file


def _rms(x, w, eps):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rope(x, pos, theta):
    d = x.shape[-1]
    inv = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    f = pos[:, None].float() * inv
    emb = torch.cat([f, f], dim=-1)[:, None, :]  # [t, 1, d] against x [t, heads, d]
    rot = torch.cat([-x[..., d // 2 :], x[..., : d // 2]], dim=-1)
    return x * emb.cos() + rot * emb.sin()


class EagerDraft:
    def __init__(self, draft_dir: Path, embed: torch.Tensor, lm_head: torch.Tensor, layer_ids=None) -> None:
        self.cfg = json.loads((draft_dir / "config.json").read_text())
        self.sd = load_file(str(draft_dir / "model.safetensors"))
        self.embed, self.lm_head = embed, lm_head
        c = self.cfg
        self.eps = c["rms_norm_eps"]
        self.theta = (c.get("rope_parameters") or {}).get("rope_theta", c.get("rope_theta", 10000.0))
        self.layer_ids = layer_ids or c["dflash_config"]["target_layer_ids"]
        self.mask_id = c["dflash_config"]["mask_token_id"]
        self.block = c["block_size"]
        self.v2 = c.get("architectures") == ["DFlash2DraftModel"]

    def fused(self, hidden_states) -> torch.Tensor:
        feats = torch.cat([hidden_states[i + 1][0] for i in self.layer_ids], dim=-1)
        return _rms(feats @ self.sd["fc.weight"].T, self.sd["hidden_norm.weight"], self.eps)

    def propose(self, ctx: torch.Tensor, last: int, p: int) -> list[int]:
        c, sd = self.cfg, self.sd
        h_, kvh, d = c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
        ids = torch.tensor([last] + [self.mask_id] * (self.block - 1))
        bpos = torch.arange(p, p + self.block)
        cpos = torch.arange(ctx.shape[0])
        x = self.embed[ids]
        for i in range(c["num_hidden_layers"]):
            w = lambda n, i=i: sd[f"layers.{i}.{n}"]  # noqa: E731
            h = _rms(x, w("input_layernorm.weight"), self.eps)
            if self.v2:
                h, after = self._conv_in(h, f"layers.{i}.attention_conv")
                x_in = x
            q = _rms((h @ w("self_attn.q_proj.weight").T).view(-1, h_, d), w("self_attn.q_norm.weight"), self.eps)
            kv_in = torch.cat([ctx, h])
            k = _rms((kv_in @ w("self_attn.k_proj.weight").T).view(-1, kvh, d), w("self_attn.k_norm.weight"), self.eps)
            v = (kv_in @ w("self_attn.v_proj.weight").T).view(-1, kvh, d)
            q, k = _rope(q, bpos, self.theta), _rope(k, torch.cat([cpos, bpos]), self.theta)
            k, v = k.repeat_interleave(h_ // kvh, dim=1), v.repeat_interleave(h_ // kvh, dim=1)
            att = torch.softmax(torch.einsum("qhd,khd->hqk", q, k) / d**0.5, dim=-1)  # no mask at all
            attn = torch.einsum("hqk,khd->qhd", att, v).reshape(len(ids), -1) @ w("self_attn.o_proj.weight").T
            x = x_in + after(attn) if self.v2 else x + attn
            h = _rms(x, w("post_attention_layernorm.weight"), self.eps)
            if self.v2:
                h, after = self._conv_in(h, f"layers.{i}.mlp_conv")
            gate, up = h @ w("mlp.gate_proj.weight").T, h @ w("mlp.up_proj.weight").T
            mlp = (torch.nn.functional.silu(gate) * up) @ w("mlp.down_proj.weight").T
            x = x + (after(mlp) if self.v2 else mlp)
        normed = _rms(x, sd["norm.weight"], self.eps)
        logits = normed @ self.lm_head.T
        if self.v2:
            return self._select(normed[1:], logits[1:], last)
        return logits[1:].argmax(-1).tolist()

    # DFlash2 (SGLang's DFlash2DraftModel as published), row by row
    def _conv_in(self, x, name):
        """The sublayer's convolved input, and the function convolving its output."""
        base, proj = self.sd[f"{name}.base_kernel"], self.sd[f"{name}.kernel_projection.weight"]
        taps, hidden = base.shape[1], base.shape[2]
        group = self.cfg["dflash_config"]["conv_group_size"]
        delta = (x @ proj.T).view(x.shape[0], 2, taps, hidden // group)

        def conv(y, side):
            out = torch.zeros_like(y)
            for row in range(y.shape[0]):
                for t in range(taps):
                    if row - t >= 0:
                        coeff = base[side, t] + delta[row, side, t].repeat_interleave(group)
                        out[row] += coeff * y[row - t]
            return out

        return conv(x, 0), lambda y: conv(y, 1)

    def _select(self, hidden, logits, anchor):
        dfc, sd = self.cfg["dflash_config"], self.sd
        z = logits * dfc.get("output_multiplier", 1.0)
        if dfc.get("final_logit_softcapping"):
            z = torch.tanh(z / dfc["final_logit_softcapping"]) * dfc["final_logit_softcapping"]
        top, cand = torch.topk(z, dfc["selector_top_k"], dim=-1)
        pred, succ = sd["candidate_selector.predecessor_codebook"], sd["candidate_selector.successor_codebook"]
        proj = hidden @ sd["candidate_selector.hidden_projection.weight"].T
        prev, path = anchor, []
        for s in range(cand.shape[0]):
            scores = [float(top[s, j] + (pred[prev] * proj[s] * succ[cand[s, j]]).sum()) for j in range(cand.shape[1])]
            prev = int(cand[s, max(range(len(scores)), key=lambda j: (scores[j], -j))])
            path.append(prev)
        return path


@torch.no_grad()
def reference_generate(
    target_dir: Path, draft_dir: Path, prompt: list[int], max_new: int, stop_ids: set[int], layer_ids=None
):
    """Greedy DFlash; returns (tokens, per-step proposals, per-step acceptance lengths)."""
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=torch.float32).eval()
    embed, head = target.get_input_embeddings().weight, target.get_output_embeddings().weight
    draft = EagerDraft(Path(draft_dir), embed, head, layer_ids)
    out = [int(target(torch.tensor([prompt])).logits[0, -1].argmax())]
    proposals, accepts = [], []
    while len(out) < max_new and out[-1] not in stop_ids:
        seq = prompt + out
        p = len(seq) - 1  # position of the last committed token, not yet seen by the target
        ctx = draft.fused(target(torch.tensor([seq[:p]]), output_hidden_states=True).hidden_states)
        d = draft.propose(ctx, seq[-1], p)
        y = target(torch.tensor([seq + d])).logits[0, p:].argmax(-1).tolist()
        a = 0
        while a < len(d) and d[a] == y[a]:
            a += 1
        committed = d[:a] + [y[a]]
        proposals.append(d)
        accepts.append(len(committed))
        for t in committed:
            if len(out) < max_new:
                out.append(t)
                if t in stop_ids:
                    break
    return out, proposals, accepts
