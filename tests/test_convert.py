"""convert: locating checkpoints, pair validation (one-line errors with hints), output layout."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from dflash_cli.checkpoints import locate as ckpt
from dflash_cli.checkpoints.weights import WeightStore
from dflash_cli.errors import CheckpointError
from dflash_cli.pairing.pair import PairInfo, default_target_layer_ids, resolve_pair
from dflash_cli.stages.base import StageContext
from dflash_cli.stages.convert import STAGE
from tests.fixtures.tiny_pairs import TinyPair, draft_tensor_shapes


def run_convert(recipe: Any, out: Path) -> dict[str, Any]:
    out.mkdir(parents=True)
    return STAGE.run(StageContext(recipe=recipe, out_dir=out, inputs={}, progress=lambda _msg: None))


def assert_one_line_error(exc: pytest.ExceptionInfo[CheckpointError], *fragments: str) -> None:
    err = exc.value
    assert err.hint, "every user error carries a hint"
    assert "\n" not in err.message
    for fragment in fragments:
        assert fragment in err.message


def edit_json(path: Path, **changes: Any) -> None:
    data = json.loads(path.read_text())
    for key, value in changes.items():
        if value is None:
            data.pop(key, None)
        else:
            data[key] = value
    path.write_text(json.dumps(data))


@pytest.fixture(params=["qwen3", "llama"])
def pair(request: pytest.FixtureRequest) -> TinyPair:
    return request.getfixturevalue(f"tiny_{request.param}_pair")


@pytest.fixture
def qwen3_copy(tmp_path: Path, tiny_qwen3_pair: TinyPair) -> TinyPair:
    return tiny_qwen3_pair.copy_to(tmp_path / "pair")


# --- output layout ---------------------------------------------------------------------------


def test_convert_writes_pair(pair: TinyPair, tmp_path: Path) -> None:
    out = tmp_path / "out"
    extras = run_convert(pair.recipe(), out)

    files = sorted(str(p.relative_to(out)) for p in out.rglob("*") if p.is_file())
    assert files == [
        "draft/config.json",
        "draft/model.safetensors",
        "draft/weights.json",
        "pair.json",
        "target/config.json",
        "target/generation_config.json",
        "target/model.safetensors",
        "target/tokenizer.json",
        "target/tokenizer_config.json",
        "target/weights.json",
    ]
    info = PairInfo.from_json((out / "pair.json").read_text())
    assert info == PairInfo(
        family=pair.family, model_type=pair.family, block_size=4, target_layer_ids=(1, 2),
        mask_token_id=pair.mask_token_id, num_target_layers=4, num_draft_layers=2, hidden_size=64,
        vocab_size=400, eos_token_ids=(0,), tie_word_embeddings=pair.family == "qwen3",
    )  # fmt: skip

    # The weights are the checkpoint's own file, hard-linked (same inode), not a rewritten copy.
    for role, src in (("target", pair.target_dir), ("draft", pair.draft_dir)):
        assert os.path.samefile(out / role / "model.safetensors", src / "model.safetensors")
    source = load_file(pair.target_dir / "model.safetensors")
    target = WeightStore.open(out / "target")
    assert set(target.names()) == set(source) | {"lm_head.weight"}
    expected_head = source["model.embed_tokens.weight"] if info.tie_word_embeddings else source["lm_head.weight"]
    assert torch.equal(target.get("lm_head.weight"), expected_head)
    if info.tie_word_embeddings:  # an alias of the embedding, not a second copy
        assert target.refs["lm_head.weight"].key == "model.embed_tokens.weight"

    draft_cfg = json.loads((out / "draft" / "config.json").read_text())
    assert draft_cfg["block_size"] == 4 and draft_cfg["num_target_layers"] == 4
    assert draft_cfg["dflash_config"] == {"mask_token_id": pair.mask_token_id, "target_layer_ids": [1, 2]}
    draft = WeightStore.open(out / "draft")
    assert {k: draft.shape(k) for k in draft.names()} == draft_tensor_shapes(draft_cfg, 2)
    assert extras["dtype"] == ["F32"] and extras["weight_files_copied"] == 0
    assert extras["draft_params"] == sum(draft.get(k).numel() for k in draft.names())


def test_convert_keeps_sharded_bf16_checkpoints_as_they_are(tiny_llama_pair: TinyPair, tmp_path: Path) -> None:
    """A sharded bf16 checkpoint: read through its index, kept in bf16, every shard linked."""
    src = tiny_llama_pair.copy_to(tmp_path / "pair")
    weights = load_file(src.target_dir / "model.safetensors")
    (src.target_dir / "model.safetensors").unlink()
    names = sorted(weights)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for fname, keys in shards.items():
        save_file(
            {k: weights[k].to(torch.bfloat16) for k in keys}, str(src.target_dir / fname), metadata={"format": "pt"}
        )
    index = {"metadata": {}, "weight_map": {k: f for f, keys in shards.items() for k in keys}}
    (src.target_dir / "model.safetensors.index.json").write_text(json.dumps(index))

    out = tmp_path / "out"
    extras = run_convert(src.recipe(), out)
    store = WeightStore.open(out / "target")
    assert sorted(store.files()) == sorted(shards)
    assert {store.refs[n].dtype for n in store.names()} == {"BF16"}
    assert "BF16" in extras["dtype"]
    for fname in shards:
        assert os.path.samefile(out / "target" / fname, src.target_dir / fname)
    assert torch.equal(store.get("lm_head.weight", torch.float32), weights["lm_head.weight"].to(torch.bfloat16).float())


def test_convert_refuses_a_target_without_tokenizer(qwen3_copy: TinyPair, tmp_path: Path) -> None:
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (qwen3_copy.target_dir / name).unlink()
    with pytest.raises(CheckpointError) as exc:
        run_convert(qwen3_copy.recipe(), tmp_path / "out")
    assert_one_line_error(exc, "no tokenizer files")


def test_converted_target_still_loads_in_transformers(tiny_qwen3_pair: TinyPair, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    run_convert(tiny_qwen3_pair.recipe(), tmp_path / "out")
    AutoTokenizer.from_pretrained(tmp_path / "out" / "target")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "out" / "target")
    reference = AutoModelForCausalLM.from_pretrained(tiny_qwen3_pair.target_dir)
    ids = torch.tensor([[5, 6, 7]])
    with torch.no_grad():
        assert torch.equal(model(ids).logits, reference(ids).logits)


def test_recipe_overrides_win_over_draft_config(tiny_qwen3_pair: TinyPair, tmp_path: Path) -> None:
    run_convert(tiny_qwen3_pair.recipe(block_size=8, target_layer_ids=[0, 3], mask_token_id=5), tmp_path / "out")
    info = PairInfo.from_json((tmp_path / "out" / "pair.json").read_text())
    assert (info.block_size, info.target_layer_ids, info.mask_token_id) == (8, (0, 3), 5)
    draft_cfg = json.loads((tmp_path / "out" / "draft" / "config.json").read_text())
    assert draft_cfg["block_size"] == 8
    assert draft_cfg["dflash_config"] == {"mask_token_id": 5, "target_layer_ids": [0, 3]}


def test_key_fields_are_json_and_track_overrides(tiny_qwen3_pair: TinyPair) -> None:
    keys = STAGE.key_fields(tiny_qwen3_pair.recipe())
    assert json.loads(json.dumps(keys)) == keys
    assert keys == STAGE.key_fields(tiny_qwen3_pair.recipe())
    assert keys != STAGE.key_fields(tiny_qwen3_pair.recipe(block_size=8))
    assert set(keys["target_fingerprint"]["weights"]) == {"model.safetensors"}


# --- locating checkpoints --------------------------------------------------------------------


def test_missing_target_dir(tiny_qwen3_pair: TinyPair, tmp_path: Path) -> None:
    recipe = tiny_qwen3_pair.recipe(target_path=str(tmp_path / "nope"))
    with pytest.raises(CheckpointError) as exc:
        STAGE.key_fields(recipe)
    assert_one_line_error(exc, "target checkpoint not found", "nope")
    assert "target.path" in exc.value.hint


def test_missing_draft_dir(tiny_qwen3_pair: TinyPair, tmp_path: Path) -> None:
    with pytest.raises(CheckpointError) as exc:
        run_convert(tiny_qwen3_pair.recipe(draft_path=str(tmp_path / "nope")), tmp_path / "out")
    assert_one_line_error(exc, "draft checkpoint not found")
    assert "draft.path" in exc.value.hint


def test_uncached_repo_id_is_not_found_offline(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError) as exc:
        ckpt.resolve_checkpoint_dir("nobody-x/not-cached", "target", cache_dir=tmp_path)
    assert_one_line_error(exc, "target checkpoint not found: nobody-x/not-cached")


def test_repo_id_resolves_from_local_hf_cache(tmp_path: Path) -> None:
    repo = tmp_path / "models--org--tiny"
    snapshot = repo / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text("{}")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("abc123")
    assert ckpt.resolve_checkpoint_dir("org/tiny", "draft", cache_dir=tmp_path) == snapshot


def test_directory_without_config(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError) as exc:
        ckpt.resolve_checkpoint_dir(str(tmp_path), "target")
    assert_one_line_error(exc, "target checkpoint has no config.json")


# --- pair validation -------------------------------------------------------------------------


def test_draft_without_dflash_config(qwen3_copy: TinyPair, tmp_path: Path) -> None:
    edit_json(qwen3_copy.draft_dir / "config.json", dflash_config=None)
    with pytest.raises(CheckpointError) as exc:
        run_convert(qwen3_copy.recipe(), tmp_path / "out")
    assert_one_line_error(exc, "no dflash_config")


def test_draft_without_block_size(qwen3_copy: TinyPair, tmp_path: Path) -> None:
    edit_json(qwen3_copy.draft_dir / "config.json", block_size=None)
    with pytest.raises(CheckpointError) as exc:
        run_convert(qwen3_copy.recipe(), tmp_path / "out")
    assert_one_line_error(exc, "no block_size")
    assert "dflash.block_size" in exc.value.hint
    run_convert(qwen3_copy.recipe(block_size=4), tmp_path / "ok")  # the recipe may supply it


def test_hidden_size_mismatch(qwen3_copy: TinyPair, tmp_path: Path) -> None:
    edit_json(qwen3_copy.draft_dir / "config.json", hidden_size=32)
    with pytest.raises(CheckpointError) as exc:
        run_convert(qwen3_copy.recipe(), tmp_path / "out")
    assert_one_line_error(exc, "hidden sizes differ", "target 64", "draft 32")


@pytest.mark.parametrize("mask", [400, 151669, -1])
def test_mask_id_outside_vocab(tiny_qwen3_pair: TinyPair, tmp_path: Path, mask: int) -> None:
    with pytest.raises(CheckpointError) as exc:
        run_convert(tiny_qwen3_pair.recipe(mask_token_id=mask), tmp_path / "out")
    assert_one_line_error(exc, f"mask_token_id {mask}", "outside the target vocabulary (size 400)")


@pytest.mark.parametrize("ids", [[1, 4], [-1, 2], []])
def test_target_layer_ids_out_of_range(tiny_qwen3_pair: TinyPair, tmp_path: Path, ids: list[int]) -> None:
    with pytest.raises(CheckpointError) as exc:
        run_convert(tiny_qwen3_pair.recipe(target_layer_ids=ids), tmp_path / "out")
    assert_one_line_error(exc, "target_layer_ids", "[0, 3]")


def test_layer_count_must_match_draft_fc(tiny_qwen3_pair: TinyPair, tmp_path: Path) -> None:
    with pytest.raises(CheckpointError) as exc:
        run_convert(tiny_qwen3_pair.recipe(target_layer_ids=[0, 1, 2]), tmp_path / "out")
    assert_one_line_error(exc, "fc.weight", "[64, 128]", "[64, 192]")


def test_recipe_family_mismatch(tiny_qwen3_pair: TinyPair, tmp_path: Path) -> None:
    with pytest.raises(CheckpointError) as exc:
        run_convert(tiny_qwen3_pair.recipe(family="llama"), tmp_path / "out")
    assert_one_line_error(exc, "recipe family 'llama'", "model_type 'qwen3'")


def test_unsupported_target_model_type(qwen3_copy: TinyPair, tmp_path: Path) -> None:
    edit_json(qwen3_copy.target_dir / "config.json", model_type="gpt2")
    with pytest.raises(CheckpointError) as exc:
        run_convert(qwen3_copy.recipe(family="gpt2"), tmp_path / "out")
    assert_one_line_error(exc, "unsupported target model_type 'gpt2'")


def test_block_size_below_two(tiny_qwen3_pair: TinyPair, tmp_path: Path) -> None:
    with pytest.raises(CheckpointError) as exc:
        run_convert(tiny_qwen3_pair.recipe(block_size=1), tmp_path / "out")
    assert_one_line_error(exc, "block_size must be an integer >= 2")


def test_draft_trained_for_other_target_depth(qwen3_copy: TinyPair, tmp_path: Path) -> None:
    edit_json(qwen3_copy.draft_dir / "config.json", num_target_layers=36)
    with pytest.raises(CheckpointError) as exc:
        run_convert(qwen3_copy.recipe(), tmp_path / "out")
    assert_one_line_error(exc, "36-layer target", "4 layers")


def test_draft_with_unexpected_keys(qwen3_copy: TinyPair, tmp_path: Path) -> None:
    path = qwen3_copy.draft_dir / "model.safetensors"
    tensors = load_file(path)
    del tensors["layers.1.mlp.up_proj.weight"]
    tensors["model.embed_tokens.weight"] = torch.zeros(400, 64)
    save_file(tensors, path)
    with pytest.raises(CheckpointError) as exc:
        run_convert(qwen3_copy.recipe(), tmp_path / "out")
    assert_one_line_error(exc, "1 missing (layers.1.mlp.up_proj.weight)", "1 unexpected (model.embed_tokens.weight)")
    assert "full causal LM" in exc.value.hint


# --- draft config fields: each one computed, or refused by name --------------------------------------------


def edit_draft_config(pair: TinyPair, dflash_config: dict[str, Any], **top: Any) -> None:
    """Merge into the draft's dflash_config and top level (None: remove the key)."""
    path = pair.draft_dir / "config.json"
    cfg = json.loads(path.read_text())
    for section, changes in ((cfg["dflash_config"], dflash_config), (cfg, top)):
        for key, value in changes.items():
            if value is None:
                section.pop(key, None)
            else:
                section[key] = value
    path.write_text(json.dumps(cfg))


@pytest.mark.parametrize(
    ("dflash_config", "top", "named"),
    [
        ({"use_target_norm": True}, {}, "dflash_config has use_target_norm True"),
        ({}, {"use_target_norm": True}, "draft config has use_target_norm True"),
        ({"attention_value_scale": 0.5}, {}, "attention_value_scale 0.5"),
        ({"output_multiplier": 2.0}, {}, "output_multiplier 2.0"),  # DFlash2's, on a DFlash draft
        ({"selector_top_k": 4}, {}, "selector_top_k 4"),
        ({"causal": True}, {}, "causal True"),
        ({"mask_token": "<|mask|>", "mask_token_id": None}, {}, "mask token '<|mask|>' but not its id"),
        ({}, {"hidden_act": "gelu"}, "hidden_act 'gelu'"),
        ({}, {"attention_bias": True}, "attention_bias True"),
        ({}, {"is_causal": True}, "is_causal True"),
        (
            {},
            {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}},
            "partial_rotary_factor 0.5",
        ),
        ({"block_size": 8}, {}, "block_size 4 at its top level and 8 in dflash_config"),
        ({}, {"target_layer_ids": [0, 3]}, "target_layer_ids [0, 3] at its top level and [1, 2] in dflash_config"),
    ],
)
def test_draft_config_field_not_computed_is_refused_by_name(
    qwen3_copy: TinyPair, tmp_path: Path, dflash_config: dict[str, Any], top: dict[str, Any], named: str
) -> None:
    """Run as if absent, each of these would make the draft propose other tokens than it was trained to."""
    edit_draft_config(qwen3_copy, dflash_config, **top)
    with pytest.raises(CheckpointError) as exc:
        run_convert(qwen3_copy.recipe(), tmp_path / "out")
    assert_one_line_error(exc, named)


def test_draft_config_fields_at_their_upstream_defaults_are_accepted(qwen3_copy: TinyPair, tmp_path: Path) -> None:
    inert = {"use_target_norm": False, "causal": False, "output_multiplier": 1.0, "projector_type": "dflash"}
    edit_draft_config(qwen3_copy, {**inert, "mask_token": "<|mask|>"}, is_causal=False, hidden_act="silu")
    run_convert(qwen3_copy.recipe(), tmp_path / "out")


def test_block_size_and_target_depth_are_read_from_dflash_config(qwen3_copy: TinyPair, tmp_path: Path) -> None:
    """Newer checkpoints keep them there only: read, not refused for a missing top-level block_size."""
    edit_draft_config(qwen3_copy, {"block_size": 4, "num_target_layers": 36}, block_size=None, num_target_layers=None)
    with pytest.raises(CheckpointError) as exc:
        run_convert(qwen3_copy.recipe(), tmp_path / "deep")
    assert_one_line_error(exc, "36-layer target")
    edit_draft_config(qwen3_copy, {"num_target_layers": 4})
    run_convert(qwen3_copy.recipe(), tmp_path / "out")
    info = PairInfo.from_json((tmp_path / "out" / "pair.json").read_text())
    assert info.block_size == 4
    resolved = json.loads((tmp_path / "out" / "draft" / "config.json").read_text())
    assert resolved["block_size"] == 4 and "block_size" not in resolved["dflash_config"]


def test_taps_and_mask_token_are_read_from_the_top_level(qwen3_copy: TinyPair, tmp_path: Path) -> None:
    """Where a config names them there only (as SGLang reads them), not the defaults in their place."""
    edit_draft_config(qwen3_copy, {"target_layer_ids": None, "mask_token_id": None}, target_layer_ids=[0, 3])
    edit_draft_config(qwen3_copy, {}, mask_token_id=7)
    run_convert(qwen3_copy.recipe(), tmp_path / "out")
    info = PairInfo.from_json((tmp_path / "out" / "pair.json").read_text())
    assert (info.target_layer_ids, info.mask_token_id) == ((0, 3), 7)


def test_default_target_layer_ids() -> None:
    assert default_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]  # published Qwen3-8B draft
    assert default_target_layer_ids(32, 5) == [1, 8, 15, 22, 29]
    assert default_target_layer_ids(36, 1) == [18]
    assert default_target_layer_ids(7, 1) == [3]


def test_defaults_apply_when_draft_omits_ids_and_mask(tiny_llama_pair: TinyPair) -> None:
    target_cfg = json.loads((tiny_llama_pair.target_dir / "config.json").read_text())
    draft_cfg = json.loads((tiny_llama_pair.draft_dir / "config.json").read_text())
    draft_cfg["dflash_config"] = {}
    generation_cfg = {"eos_token_id": [9, 0]}
    info = resolve_pair(target_cfg, draft_cfg, tiny_llama_pair.recipe(), 200_000, generation_cfg=generation_cfg)
    assert info.target_layer_ids == (1, 1)  # formula on a 4-layer target: 1 .. N-3
    assert info.mask_token_id == 128002  # the llama family default
    assert info.eos_token_ids == (9, 0)


def test_pair_info_json_round_trip() -> None:
    info = PairInfo("qwen3", "qwen3", 16, (1, 9), 151669, 36, 5, 4096, 151936, (151645, 151643), False, 2.5)
    assert PairInfo.from_json(info.to_json()) == info
    assert json.loads(info.to_json())["target_layer_ids"] == [1, 9]


# --- damaged weights and fingerprints --------------------------------------------------------


def test_truncated_safetensors(qwen3_copy: TinyPair, tmp_path: Path) -> None:
    path = qwen3_copy.target_dir / "model.safetensors"
    with path.open("r+b") as f:
        f.truncate(path.stat().st_size // 2)
    with pytest.raises(CheckpointError) as exc:
        run_convert(qwen3_copy.recipe(), tmp_path / "out")
    assert_one_line_error(exc, "truncated safetensors file", str(path))
    with pytest.raises(CheckpointError):
        STAGE.key_fields(qwen3_copy.recipe())  # fails fast, before any stage runs


def test_bad_safetensors_header(qwen3_copy: TinyPair) -> None:
    path = qwen3_copy.draft_dir / "model.safetensors"
    data = bytearray(path.read_bytes())
    data[:8] = (10**12).to_bytes(8, "little")
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError) as exc:
        WeightStore.open(qwen3_copy.draft_dir)
    assert_one_line_error(exc, "corrupt safetensors file", "model.safetensors", "header claims")


def test_sharded_checkpoint_loads(tiny_llama_pair: TinyPair, tmp_path: Path) -> None:
    tensors = load_file(tiny_llama_pair.target_dir / "model.safetensors")
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for file, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, tmp_path / file)
    weight_map = {k: file for file, keys in shards.items() for k in keys}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    loaded = WeightStore.open(tmp_path)
    assert set(loaded.names()) == set(tensors) and all(torch.equal(loaded.get(k), tensors[k]) for k in names)
    assert set(ckpt.fingerprint(tmp_path)["weights"]) == set(shards)


def test_fingerprint_is_stable(tiny_qwen3_pair: TinyPair) -> None:
    assert ckpt.fingerprint(tiny_qwen3_pair.target_dir) == ckpt.fingerprint(tiny_qwen3_pair.target_dir)


def test_fingerprint_sees_tail_edit_even_with_same_size_and_mtime(qwen3_copy: TinyPair) -> None:
    path = qwen3_copy.target_dir / "model.safetensors"
    before = ckpt.fingerprint(qwen3_copy.target_dir)
    stat = path.stat()
    with path.open("r+b") as f:
        f.seek(-4, os.SEEK_END)
        f.write(b"\x01\x02\x03\x04")
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert path.stat().st_size == stat.st_size
    assert ckpt.fingerprint(qwen3_copy.target_dir) != before


def test_fingerprint_sees_appended_bytes(qwen3_copy: TinyPair) -> None:
    before = ckpt.fingerprint(qwen3_copy.draft_dir)
    with (qwen3_copy.draft_dir / "model.safetensors").open("ab") as f:
        f.write(b"\0" * 16)
    assert ckpt.fingerprint(qwen3_copy.draft_dir) != before


def test_fingerprint_sees_config_and_tokenizer_edits(qwen3_copy: TinyPair) -> None:
    before = ckpt.fingerprint(qwen3_copy.target_dir)
    edit_json(qwen3_copy.target_dir / "config.json", rms_norm_eps=1e-5)
    after_config = ckpt.fingerprint(qwen3_copy.target_dir)
    assert after_config != before
    edit_json(qwen3_copy.target_dir / "tokenizer_config.json", model_max_length=64)
    assert ckpt.fingerprint(qwen3_copy.target_dir) != after_config


def test_written_recipe_drives_convert(tiny_llama_pair: TinyPair, tmp_path: Path) -> None:
    from dflash_cli.recipe.schema import load_recipe

    recipe = load_recipe(str(tiny_llama_pair.write_recipe(tmp_path / "tiny.yaml")))
    assert STAGE.key_fields(recipe) == STAGE.key_fields(tiny_llama_pair.recipe(block_size=4))
    run_convert(recipe, tmp_path / "out")
    assert PairInfo.from_json((tmp_path / "out" / "pair.json").read_text()).block_size == 4
