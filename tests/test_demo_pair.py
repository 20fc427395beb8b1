"""The shipped demo pair: real formats, lossless through the toolchain, and a draft that really accepts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TARGET, DRAFT = ROOT / "models" / "demo-target", ROOT / "models" / "demo-draft"

pytestmark = pytest.mark.skipif(not (DRAFT / "model.safetensors").exists(), reason="demo pair not trained yet")


@pytest.fixture(scope="module")
def demo_engine(tmp_path_factory):
    from dflash_cli.cache.store import Cache
    from dflash_cli.decoding.engine import build_engine
    from dflash_cli.recipe.schema import load_recipe

    return build_engine(load_recipe("demo"), Cache(tmp_path_factory.mktemp("demo-cache")))


def _prompts(engine, n):
    from dflash_cli.bench.datasets import load_dataset

    return [engine.encode_prompt(s.turns[0]) for s in load_dataset("humaneval", max_samples=n, seed=1)]


def test_formats():
    from transformers import AutoModelForCausalLM

    cfg = json.loads((DRAFT / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"] and "dflash_config" in cfg and "block_size" in cfg
    AutoModelForCausalLM.from_pretrained(str(TARGET))
    assert sum(f.stat().st_size for f in (ROOT / "models").rglob("*") if f.is_file()) < 50 * 2**20


def test_lossless_and_accepting(demo_engine):
    accepted = []
    for ids in _prompts(demo_engine, 6):
        plain = demo_engine.generate(ids, mode="plain", max_new_tokens=48)
        dflash = demo_engine.generate(ids, mode="dflash", max_new_tokens=48)
        assert dflash.tokens == plain.tokens
        accepted.append(dflash.tau)
    # A trained draft commits clearly more than one token per step (random drafts give 1.0).
    assert sum(accepted) / len(accepted) > 1.5


def test_per_step_parity_with_eager_reference(demo_engine):
    from tests.reference_dflash import reference_generate
    from tests.test_reference_parity import run_toolchain

    for ids in _prompts(demo_engine, 2):
        ours, props = run_toolchain(demo_engine, ids, 24)
        ref_tokens, ref_props, ref_acc = reference_generate(TARGET, DRAFT, ids, 24, set(demo_engine.eos_token_ids))
        assert (ours.tokens, props, ours.accept_lengths) == (ref_tokens, ref_props, ref_acc)


DRAFT2 = ROOT / "models" / "demo-draft2"


@pytest.fixture(scope="module")
def demo2_engine(tmp_path_factory):
    from dflash_cli.cache.store import Cache
    from dflash_cli.decoding.engine import build_engine
    from dflash_cli.recipe.schema import load_recipe

    return build_engine(load_recipe("demo-dflash2"), Cache(tmp_path_factory.mktemp("demo2-cache")))


def test_the_dflash2_demo_draft_is_lossless_accepts_and_matches_the_eager_reading(demo2_engine):
    """The shipped DFlash2 draft (recipe demo-dflash2): trained weights through the whole pipeline."""
    from tests.reference_dflash import reference_generate
    from tests.test_reference_parity import run_toolchain

    assert json.loads((DRAFT2 / "config.json").read_text())["architectures"] == ["DFlash2DraftModel"]
    accepted = []
    for ids in _prompts(demo2_engine, 6):
        plain = demo2_engine.generate(ids, mode="plain", max_new_tokens=48)
        dflash = demo2_engine.generate(ids, mode="dflash", max_new_tokens=48)
        assert dflash.tokens == plain.tokens
        accepted.append(dflash.tau)
    assert sum(accepted) / len(accepted) > 1.5
    for ids in _prompts(demo2_engine, 2):
        ours, props = run_toolchain(demo2_engine, ids, 24)
        ref_tokens, ref_props, ref_acc = reference_generate(TARGET, DRAFT2, ids, 24, set(demo2_engine.eos_token_ids))
        assert (ours.tokens, props, ours.accept_lengths) == (ref_tokens, ref_props, ref_acc)
