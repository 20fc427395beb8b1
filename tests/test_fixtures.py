"""The tiny pairs are real checkpoints: transformers loads them, the draft has the z-lab layout."""

from __future__ import annotations

import json

import pytest
import torch
import yaml
from safetensors import safe_open

from tests.fixtures.tiny_pairs import EOS_TOKEN, MASK_TOKEN, TinyPair, draft_tensor_shapes, make_pair, write_tokenizer


@pytest.fixture(params=["qwen3", "llama"])
def pair(request: pytest.FixtureRequest) -> TinyPair:
    return request.getfixturevalue(f"tiny_{request.param}_pair")


def test_tokenizer_loads_with_autotokenizer(tmp_path):
    from transformers import AutoTokenizer

    size = write_tokenizer(tmp_path)
    tok = AutoTokenizer.from_pretrained(tmp_path)
    assert 320 <= size == len(tok) <= 512
    assert tok.eos_token == EOS_TOKEN
    assert tok.convert_tokens_to_ids(MASK_TOKEN) != tok.eos_token_id
    text = "def add(a, b): return a + b"
    assert tok.decode(tok(text)["input_ids"]) == text


def test_target_loads_and_runs(pair):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(pair.target_dir).eval()
    assert model.config.model_type == pair.family
    with torch.no_grad():
        out = model(torch.tensor([[3, 4, 5]]), output_hidden_states=True)
    assert out.logits.shape == (1, 3, model.config.vocab_size)
    assert len(out.hidden_states) == model.config.num_hidden_layers + 1


def test_target_lm_head_on_disk_only_when_untied(pair):
    with safe_open(pair.target_dir / "model.safetensors", "pt") as f:
        has_lm_head = "lm_head.weight" in f.keys()  # safe_open is not a container
    cfg = json.loads((pair.target_dir / "config.json").read_text())
    assert cfg["tie_word_embeddings"] is (pair.family == "qwen3")
    assert has_lm_head is (pair.family == "llama")


def test_draft_has_exactly_the_zlab_layout(pair):
    cfg = json.loads((pair.draft_dir / "config.json").read_text())
    target = json.loads((pair.target_dir / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"] and cfg["model_type"] == "qwen3"
    assert cfg["block_size"] == pair.block_size == 4
    assert cfg["num_target_layers"] == target["num_hidden_layers"] == 4
    assert cfg["dflash_config"] == {"mask_token_id": pair.mask_token_id, "target_layer_ids": [1, 2]}
    assert cfg["hidden_size"] == target["hidden_size"] and cfg["vocab_size"] == target["vocab_size"]
    with safe_open(pair.draft_dir / "model.safetensors", "pt") as f:
        shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    assert shapes == draft_tensor_shapes(cfg, 2)
    assert not any(k.startswith("model.") or "embed" in k or "lm_head" in k for k in shapes)


def test_pairs_are_deterministic(tmp_path, tiny_qwen3_pair):
    again = make_pair(tmp_path, "qwen3")
    for role in ("target_dir", "draft_dir"):
        a = getattr(again, role) / "model.safetensors"
        b = getattr(tiny_qwen3_pair, role) / "model.safetensors"
        assert a.read_bytes() == b.read_bytes()


def test_write_recipe(tmp_path, tiny_llama_pair):
    path = tiny_llama_pair.write_recipe(tmp_path, dflash={"mask_token_id": 7}, export={"ctx_len": 256})
    data = yaml.safe_load(path.read_text())
    assert path == tmp_path / "recipe.yaml"
    assert data["family"] == "llama"
    assert data["target"]["path"] == str(tiny_llama_pair.target_dir)
    assert data["draft"]["path"] == str(tiny_llama_pair.draft_dir)
    assert data["dflash"] == {"block_size": 4, "mask_token_id": 7}
    assert data["export"] == {"ctx_len": 256, "prefill_seq_len": 8}
    assert data["compile"] == {"backend": "ort"}
