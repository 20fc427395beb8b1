"""Locate, check and fingerprint Hugging Face checkpoints (tensors themselves are read by checkpoints/weights.py).

Locating is offline only: a local directory, else a repo id already in the local Hugging Face
cache. Nothing global (env vars, hub settings) is changed to get there.

Fingerprints feed stage cache keys, so they must be cheap even for tens of GB of weights and
still change whenever the checkpoint does. The choice made here:

* small side files (config, generation config, tokenizer files, shard index; < 5 MB) are
  hashed in full;
* every safetensors file contributes its size, mtime_ns, the sha256 of its JSON header (which
  names every tensor with dtype, shape and byte offsets, so any structural change shows) and the
  sha256 of its last 1 MiB (so an in-place edit of tail weights shows even if size and mtime
  were preserved);
* larger side files (e.g. an 11 MB tokenizer.json) are treated like weights.

An in-place edit in the middle of a weight file that also restores the mtime would go unseen;
that is the accepted price of not hashing gigabytes on every build.
"""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from dflash_cli.errors import CheckpointError

if TYPE_CHECKING:
    import torch

Role = Literal["target", "draft"]

CONFIG_FILE = "config.json"
SOURCE_CONFIG_FILE = "source_config.json"  # convert's copy of a checkpoint's config.json where its own differs
GENERATION_CONFIG_FILE = "generation_config.json"
SINGLE_WEIGHTS_FILE = "model.safetensors"
SHARD_INDEX_FILE = "model.safetensors.index.json"
# Tokenizer and chat-template files a target may ship; convert copies whichever exist.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "chat_template.jinja",
    "chat_template.json",
)
# A vision-language checkpoint's image preprocessing (its own processor, loaded at run time).
PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json", "video_preprocessor_config.json")
SIDE_FILES = (CONFIG_FILE, GENERATION_CONFIG_FILE, SHARD_INDEX_FILE, *TOKENIZER_FILES, *PROCESSOR_FILES)

SMALL_FILE_BYTES = 5 * 1024 * 1024
TAIL_BYTES = 1024 * 1024
MAX_HEADER_BYTES = 100 * 1024 * 1024  # the safetensors format's own limit


def resolve_checkpoint_dir(path_or_repo: str, role: Role, *, cache_dir: Path | None = None) -> Path:
    """A local directory, else a repo id from the local Hugging Face cache (never the network)."""
    local = Path(path_or_repo).expanduser()
    found = local.resolve() if local.is_dir() else _from_hf_cache(path_or_repo, cache_dir)
    if found is None:
        raise CheckpointError(
            f"{role} checkpoint not found: {path_or_repo}",
            hint=f"pass a local directory in {role}.path, or download it into the Hugging Face cache "
            "on a machine with network",
        )
    if not (found / CONFIG_FILE).is_file():
        raise CheckpointError(
            f"{role} checkpoint has no {CONFIG_FILE}: {found}",
            hint=f"point {role}.path at a Hugging Face model directory (config.json + safetensors)",
        )
    return found


def _from_hf_cache(repo_id: str, cache_dir: Path | None) -> Path | None:
    from huggingface_hub import snapshot_download

    try:
        # local_files_only makes this a pure cache lookup: no request is ever sent.
        return Path(snapshot_download(repo_id, local_files_only=True, cache_dir=cache_dir))
    except (OSError, ValueError):  # not cached (LocalEntryNotFoundError) or not a repo id (HFValidationError)
        return None


def load_json(path: Path, what: str) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise CheckpointError(f"{what} not found: {path}", hint="check the checkpoint directory") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{what} is not valid JSON: {path} ({exc})", hint="re-download the checkpoint") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{what} is not a JSON object: {path}", hint="re-download the checkpoint")
    return data


def load_config(checkpoint_dir: Path) -> dict[str, Any]:
    return load_json(Path(checkpoint_dir) / CONFIG_FILE, CONFIG_FILE)


def load_generation_config(checkpoint_dir: Path) -> dict[str, Any] | None:
    path = Path(checkpoint_dir) / GENERATION_CONFIG_FILE
    return load_json(path, GENERATION_CONFIG_FILE) if path.is_file() else None


def weight_files(checkpoint_dir: Path) -> list[Path]:
    """The safetensors files holding the weights: the shard index's files, else model.safetensors."""
    checkpoint_dir = Path(checkpoint_dir)
    index = checkpoint_dir / SHARD_INDEX_FILE
    if index.is_file():
        weight_map = load_json(index, SHARD_INDEX_FILE).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise CheckpointError(f"shard index has no weight_map: {index}", hint="re-download the checkpoint")
        files = [checkpoint_dir / name for name in sorted(set(weight_map.values()))]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise CheckpointError(
                f"shard index names missing files: {', '.join(missing[:3])} in {checkpoint_dir}",
                hint="the download is incomplete; download the checkpoint again",
            )
        return files
    single = checkpoint_dir / SINGLE_WEIGHTS_FILE
    if single.is_file():
        return [single]
    raise CheckpointError(
        f"no safetensors weights in {checkpoint_dir}",
        hint=f"expected {SINGLE_WEIGHTS_FILE} or {SHARD_INDEX_FILE}; convert .bin checkpoints to safetensors",
    )


def read_safetensors_header(path: Path) -> bytes:
    """The raw JSON header of a safetensors file, after checking the file is complete."""
    hint = "the file is truncated or corrupt; download or convert the checkpoint again"
    size = path.stat().st_size
    with path.open("rb") as f:
        prefix = f.read(8)
        if len(prefix) < 8:
            raise CheckpointError(f"corrupt safetensors file {path}: shorter than its 8-byte header length", hint=hint)
        (header_len,) = struct.unpack("<Q", prefix)
        if header_len > MAX_HEADER_BYTES or 8 + header_len > size:
            raise CheckpointError(
                f"corrupt safetensors file {path}: header claims {header_len} bytes, file has {size}", hint=hint
            )
        raw = f.read(header_len)
    try:
        header = json.loads(raw)
        ends = [int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"]
    except (ValueError, TypeError, KeyError, IndexError):
        raise CheckpointError(f"corrupt safetensors file {path}: unreadable header", hint=hint) from None
    needed = 8 + header_len + max(ends, default=0)
    if needed > size:
        raise CheckpointError(f"truncated safetensors file {path}: needs {needed} bytes, has {size}", hint=hint)
    return raw


def fingerprint(checkpoint_dir: Path) -> dict[str, Any]:
    """Cheap identity of a checkpoint for cache keys (see the module docstring for what it covers)."""
    checkpoint_dir = Path(checkpoint_dir)
    side: dict[str, Any] = {}
    for name in SIDE_FILES:
        path = checkpoint_dir / name
        if path.is_file():
            side[name] = _sha256_file(path) if path.stat().st_size < SMALL_FILE_BYTES else _large_file_id(path)
    weights = {
        path.name: {**_large_file_id(path), "header_sha256": hashlib.sha256(read_safetensors_header(path)).hexdigest()}
        for path in weight_files(checkpoint_dir)
    }
    return {"files": side, "weights": weights}


def _sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _large_file_id(path: Path) -> dict[str, Any]:
    stat = path.stat()  # follows Hugging Face cache symlinks to the blob
    with path.open("rb") as f:
        f.seek(max(0, stat.st_size - TAIL_BYTES))
        tail = hashlib.sha256(f.read()).hexdigest()
    return {"size": stat.st_size, "mtime_ns": stat.st_mtime_ns, "tail_sha256": tail}


def save_state_dict(tensors: dict[str, torch.Tensor], path: Path) -> None:
    """Write tensors as safetensors with the metadata transformers expects when loading."""
    from safetensors.torch import save_file

    # contiguous + distinct storage: safetensors refuses views and shared tensors
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path), metadata={"format": "pt"})
