"""fp16 agreement end to end on a tiny pair: both runs happen, divergences are recorded with fp32 logit gaps."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dflash_cli.readiness.fp16_agreement import fp16_agreement
from dflash_cli.readiness.logit_gap import LogitGap
from tests.engines import build_recipe


@pytest.fixture(scope="module")
def built(tiny_qwen3_pair, tmp_path_factory):
    from dflash_cli.decoding.engine import Engine
    from dflash_cli.stages.pipeline import build

    recipe, cache = build_recipe(tiny_qwen3_pair, tmp_path_factory.mktemp("fp16_agreement"))
    return Engine.load(recipe, cache), build(recipe, cache)


class _SwapAware:
    """Wraps a real engine; answers with a different last token whenever fp16 sessions are plugged in."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self.fp32_target = engine.target

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def __setattr__(self, name, value):
        if name in ("target", "draft"):
            setattr(self.engine, name, value)
        else:
            object.__setattr__(self, name, value)

    def generate(self, ids, **kw):
        out = self.engine.generate(ids, **kw)
        if self.engine.target is not self.fp32_target:
            out.tokens[-1] = out.tokens[-1] + 1  # a divergence at the last position
        return out


def test_real_graphs_run_in_fp16_and_compare(built) -> None:
    engine, result = built
    prompts = [[5, 6, 7, 8], [9, 10, 11], [3, 4, 5, 6, 7]]
    got = fp16_agreement(engine, result.path("export"), prompts, max_new_tokens=6)
    assert got.prompts == 3 and not got.nonfinite
    assert got.identical == sum(d is None for d in got.first_divergence)
    assert len(got.divergences) == 3 - got.identical
    assert engine.target.name == "target" and not hasattr(engine.target, "inner")  # fp32 sessions restored


def test_divergences_record_tokens_and_gap(built) -> None:
    engine, result = built
    calls = []

    def gap(ids, a, b):
        calls.append((list(ids), a, b))
        return {"gap": 0.5, "fp16_rank": 2}

    got = fp16_agreement(_SwapAware(engine), result.path("export"), [[5, 6, 7, 8]], max_new_tokens=6, logit_gap=gap)
    assert got.identical == 0 and got.first_divergence == [5]
    (d,) = got.divergences
    assert d["prompt"] == 0 and d["position"] == 5 and d["fp16_token"] == d["fp32_token"] + 1
    assert d["gap"] == 0.5 and got.to_dict()["max_divergence_gap"] == 0.5
    # the gap is asked for at the prompt plus the fp32 tokens before the divergence
    assert len(calls) == 1 and calls[0][0][:4] == [5, 6, 7, 8] and len(calls[0][0]) == 4 + 5


def test_logit_gap_matches_the_model(tiny_qwen3_pair) -> None:
    from transformers import AutoModelForCausalLM

    measure = LogitGap(Path(tiny_qwen3_pair.target_dir))
    model = AutoModelForCausalLM.from_pretrained(str(tiny_qwen3_pair.target_dir), dtype=torch.float32).eval()
    ids = [3, 1, 4, 1, 5]
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0, -1]
    order = torch.argsort(logits, descending=True).tolist()
    got = measure(ids, order[0], order[2])
    assert got["fp16_rank"] == 3
    assert got["gap"] == pytest.approx(float(logits[order[0]] - logits[order[2]]), abs=1e-6)
    assert measure(ids, order[0], order[0]) == {"gap": 0.0, "fp16_rank": 1}
