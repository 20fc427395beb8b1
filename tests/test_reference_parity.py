"""Per-step draft tokens and acceptance lengths equal an independent eager implementation."""

from __future__ import annotations

import json

import numpy as np
import pytest

from dflash_cli.decoding.loops import DFlashProposer, LoopConfig, generate_speculative
from dflash_cli.decoding.target_calls import TimedSession
from tests.reference_dflash import reference_generate


class Recording(DFlashProposer):
    def __init__(self, *args):
        super().__init__(*args)
        self.proposals = []

    def propose(self, history, last, pos, limit):
        d = super().propose(history, last, pos, limit)
        self.proposals.append(d)
        return d


def run_toolchain(engine, prompt, max_new):
    engine.target.reset()
    engine.draft.reset()
    proposer = Recording(TimedSession(engine.draft), engine.block_size, engine.mask_token_id, engine.prefill_len)
    cfg = LoopConfig(max_new, frozenset(engine.eos_token_ids))
    res = generate_speculative(
        TimedSession(engine.target), proposer, prompt, engine.prefill_len, engine.block_size, cfg
    )
    return res, proposer.proposals


@pytest.mark.parametrize("engine_name", ["qwen3_engine", "llama_engine", "qwen3_last_layer_engine"])
def test_per_step_parity_with_eager_reference(engine_name, request):
    engine = request.getfixturevalue(engine_name)
    pair = request.getfixturevalue(f"tiny_{'llama' if 'llama' in engine_name else 'qwen3'}_pair")
    layer_ids = json.loads((engine.export_dir / "pair.json").read_text())["target_layer_ids"]
    rng = np.random.default_rng(7)
    for n in (3, 9, 17):  # shorter than, equal to about, and longer than the prefill chunk
        prompt = list(map(int, rng.integers(2, engine.tokenizer.vocab_size, size=n)))
        ours, our_props = run_toolchain(engine, prompt, 12)
        ref_tokens, ref_props, ref_acc = reference_generate(
            pair.target_dir, pair.draft_dir, prompt, 12, set(engine.eos_token_ids), layer_ids
        )
        assert ours.tokens == ref_tokens
        assert our_props == ref_props
        assert ours.accept_lengths == ref_acc
