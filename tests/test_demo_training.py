"""Smoke test of the demo-pair training loops: a few steps each, resumable, real output formats."""

from __future__ import annotations

import json

import pytest
from safetensors import safe_open

pytestmark = pytest.mark.slow  # builds or exports pairs: left out of `make test-fast`


def test_target_and_draft_training_loops(tmp_path):
    from transformers import AutoModelForCausalLM

    from dflash_cli.demo import train_draft, train_target

    work, target, draft = tmp_path / "work", tmp_path / "target", tmp_path / "draft"
    common = [
        "--work-dir",
        str(work),
        "--out",
        str(target),
        "--smoke",
        "--max-files",
        "12",
        "--batch-size",
        "2",
        "--seq-len",
        "32",
        "--ckpt-every",
        "2",
        "--warmup",
        "1",
        "--threads",
        "1",
    ]
    train_target.main([*common, "--steps", "2"])
    train_target.main([*common, "--steps", "3"])  # resumes from the step-2 checkpoint
    meta = json.loads((target / "training.json").read_text())
    assert meta["steps"] == 3 and meta["heldout_loss"] > 0
    AutoModelForCausalLM.from_pretrained(str(target))  # plain Hugging Face format

    draft_args = [
        "--max-files",
        "12",
        "--n-seqs",
        "4",
        "--heldout-seqs",
        "4",
        "--distill-batch",
        "4",
        "--new-tokens",
        "24",
        "--steps",
        "2",
        "--batch-size",
        "2",
        "--anchors",
        "4",
        "--block-size",
        "4",
        "--threads",
        "1",
    ]
    train_draft.main(["--work-dir", str(work), "--target", str(target), "--out", str(draft), *draft_args])
    cfg = json.loads((draft / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"] and cfg["block_size"] == 4
    assert cfg["dflash_config"]["target_layer_ids"] == [1, 3, 5] and cfg["num_target_layers"] == 6
    with safe_open(str(draft / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
    assert {"fc.weight", "hidden_norm.weight", "norm.weight", "layers.0.self_attn.q_proj.weight"} <= keys
    assert not any(k.startswith(("embed_tokens", "lm_head", "model.")) for k in keys)

    # A DFlash2 draft: its convolution and selector saved under the published names, and trained (the
    # successor codebook starts at zero, which leaves the walk at each position's argmax)
    v2 = tmp_path / "draft-v2"
    v2_args = ["--dflash2", "--selector-rank", "8", "--selector-top-k", "4"]
    train_draft.main(
        ["--work-dir", str(tmp_path / "work-v2"), "--target", str(target), "--out", str(v2), *draft_args, *v2_args]
    )
    cfg2 = json.loads((v2 / "config.json").read_text())
    assert cfg2["architectures"] == ["DFlash2DraftModel"] and cfg2["dflash_config"]["selector_top_k"] == 4
    with safe_open(str(v2 / "model.safetensors"), "pt") as f:
        assert {"layers.1.mlp_conv.base_kernel", "candidate_selector.predecessor_codebook"} <= set(f.keys())
        assert f.get_tensor("candidate_selector.successor_codebook").abs().sum() > 0

    # Continued runs: the target from its saved weights (fresh optimizer, own checkpoint), the draft warm-started.
    target2, draft2 = tmp_path / "target2", tmp_path / "draft2"
    cont = [*common[:2], "--out", str(target2), *common[4:], "--init-from", str(target), "--run-name", "cont"]
    train_target.main([*cont, "--steps", "1", "--seed", "1"])
    meta2 = json.loads((target2 / "training.json").read_text())
    assert meta2["steps"] == 1 and meta2["continued_from"]["steps"] == 3
    assert meta2["total_train_seconds"] >= meta["train_seconds"]
    work2 = tmp_path / "work2"  # created by the loop
    args2 = ["--work-dir", str(work2), "--target", str(target2), "--out", str(draft2), "--init-from", str(draft)]
    train_draft.main([*args2, *draft_args, "--prompt-lens", "8,12"])
    assert (draft2 / "model.safetensors").exists()

    # Unlikelihood fine-tuning of the target: resumable, plain Hugging Face output, lineage recorded.
    from dflash_cli.demo import unlikelihood

    target3 = tmp_path / "target3"
    ul = ["--init-from", str(target), "--work-dir", str(tmp_path / "work3"), "--out", str(target3)]
    ul += ["--max-files", "12", "--ul-batch", "2", "--new-tokens", "12", "--prompt-lens", "8"]
    ul += ["--mle-batch", "2", "--seq-len", "32", "--ckpt-every", "1", "--threads", "1"]
    unlikelihood.main([*ul, "--steps", "1"])
    unlikelihood.main([*ul, "--steps", "2"])  # resumes from the step-1 checkpoint
    meta3 = json.loads((target3 / "training.json").read_text())
    assert meta3["steps"] == 2 and meta3["continued_from"]["steps"] == 3 and meta3["heldout_loss"] > 0
    log = [json.loads(line) for line in (tmp_path / "work3" / "ul-train.log").read_text().splitlines()]
    assert [r["step"] for r in log if "ul" in r] == [1, 2]
    AutoModelForCausalLM.from_pretrained(str(target3))


def test_docstring_prompt_ends():
    import numpy as np

    from dflash_cli.demo.distill import docstring_ends, prompt_starts

    # token texts as byte-level BPE produces them: a newline may carry the next line's indentation
    texts = ["def f():", "\n    ", '"""Doc', '."""', "\n    ", "return 1", "\n", '"""', "x", "\n"]
    tokens = np.arange(len(texts))
    ends = docstring_ends(tokens, texts)
    assert ends.tolist() == [4]  # '"""' followed by 'x' is not a line end; '"""Doc' is not a close
    starts = prompt_starts(tokens, set(), 1, 3, 5, np.random.default_rng(0), ends)
    assert starts.tolist() == [2]  # the prompt is tokens 2..4 and ends on the docstring's line end
    with pytest.raises(SystemExit, match="usable prompt ends"):
        prompt_starts(tokens, set(), 2, 3, 5, np.random.default_rng(0), ends)
