"""Llama 3.1's `llama3` RoPE scaling: our export matches Hugging Face and stays lossless."""

from __future__ import annotations

import json

import numpy as np

from tests.engines import open_engine
from tests.fixtures.tiny_pairs import TinyPair, write_dflash_draft, write_llama_target

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,  # small, so the scaled band covers the test positions
}


def test_llama3_rope_scaling(tmp_path):
    target = write_llama_target(tmp_path / "target", rope_parameters=LLAMA3_ROPE)
    assert json.loads((target / "config.json").read_text())["rope_parameters"]["rope_type"] == "llama3"
    draft = write_dflash_draft(tmp_path / "draft", target)
    engine = open_engine(TinyPair("llama", target, draft, 4, 1), tmp_path)  # export validates vs HF
    checks = json.loads((engine.export_dir / "validation.json").read_text())["checks"]
    assert all(c["ok"] for c in checks) and any(c["call"] == "vs-huggingface" for c in checks)
    rng = np.random.default_rng(3)
    for n in (5, 40, 90):
        prompt = list(map(int, rng.integers(2, engine.tokenizer.vocab_size, size=n)))
        plain = engine.generate(prompt, mode="plain", max_new_tokens=16)
        assert engine.generate(prompt, mode="dflash", max_new_tokens=16).tokens == plain.tokens
