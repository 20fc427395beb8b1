"""Lazy, tensor-by-tensor access to the weights of a checkpoint or a stage artifact.

A weight directory is read through, in order of preference:
* `weights.json` (written by our stages): name -> {"file", "key"}; several names may point at one
  stored tensor (a tied lm_head, the draft's embedding that is the target's), so nothing is copied;
  `stacks` name tensors assembled from stored ones as they are read (a MoE layer's experts, one
  tensor per expert in the checkpoint, read as one [experts, rows, cols] tensor);
* `model.safetensors.index.json` (a sharded Hugging Face checkpoint);
* `model.safetensors`.

Tensors are read one at a time with `safetensors.safe_open` (memory-mapped), never a whole state
dict, and converted to the caller's dtype only as they are handed out.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dflash_cli.checkpoints import locate as ckpt
from dflash_cli.errors import CheckpointError

if TYPE_CHECKING:
    import torch

WEIGHTS_INDEX = "weights.json"
WEIGHTS_INDEX_FORMAT = 1
_HINT = "the file is truncated or corrupt; download or convert the checkpoint again"


@dataclass(frozen=True)
class TensorRef:
    file: str  # relative to the weight directory
    key: str  # the name stored in that file
    dtype: str  # safetensors dtype name (BF16, F16, F32, ...)
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * _DTYPE_BYTES.get(self.dtype, 4)


_DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}


@dataclass(frozen=True)
class Stack:
    """A tensor of slabs read from stored ones, one slab (an expert) at a time, by `kind`:
    * "rows": [len(parts) / interleave, interleave * rows, cols] from stored [rows, cols] tensors, each group
      of `interleave` consecutive parts one slab whose rows alternate between them;
    * "transpose": one stored [slabs, cols, rows] tensor, each slab transposed;
    * "mxfp4": parts (blocks, scales), OCP MXFP4 as gpt-oss stores it: blocks [slabs, rows, groups, 16] bytes
      of two 4-bit E2M1 values (low nibble first), scales [slabs, rows, groups] E8M0 exponents (bias 127),
      read as [slabs, rows, groups * 32];
    * "regroup": one stored [rows, cols] tensor whose rows form `interleave` equal groups (one per head): for each
      of `spans` (start, stop) in turn, those rows of every group in order, read as a 2-D tensor. A projection
      fused per head (Qwen3-Next's q, k, v, z of each key head) is then read as separate ones, nothing copied.
    A stack may carry a stored tensor's own name: the stack is then what the name reads."""

    parts: tuple[str, ...]
    interleave: int = 1
    kind: str = "rows"
    spans: tuple[tuple[int, int], ...] = ()  # "regroup" only


# E2M1 (MXFP4's element type): the value of each 4-bit code, the sign in the top bit
_FP4 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


class WeightStore:
    """Name -> tensor, read lazily from safetensors files in one directory."""

    def __init__(self, root: Path, refs: dict[str, TensorRef], stacks: dict[str, Stack] | None = None) -> None:
        self.root = Path(root)
        self.refs = refs
        self.stacks = stacks or {}
        self._handles: dict[str, Any] = {}

    @classmethod
    def open(cls, root: Path) -> WeightStore:
        root = Path(root)
        index = root / WEIGHTS_INDEX
        if index.is_file():
            data = ckpt.load_json(index, WEIGHTS_INDEX)
            entries = data.get("tensors")
            if not isinstance(entries, dict):
                raise CheckpointError(f"{index} lists no tensors", hint="rebuild this stage: `--rebuild convert`")
            headers = {f: _header(root / f) for f in sorted({e["file"] for e in entries.values()})}
            refs = {}
            for name, e in entries.items():
                meta = headers[e["file"]].get(e["key"])
                if meta is None:
                    raise CheckpointError(
                        f"{e['file']} has no tensor {e['key']} (named {name} in {index})",
                        hint="rebuild this stage: `--rebuild convert`",
                    )
                refs[name] = TensorRef(e["file"], e["key"], meta["dtype"], tuple(meta["shape"]))
            stacks = {
                n: Stack(
                    tuple(v["parts"]),
                    int(v["interleave"]),
                    str(v.get("kind", "rows")),
                    tuple((int(a), int(b)) for a, b in v.get("spans", ())),
                )
                for n, v in data.get("stacks", {}).items()
            }
            missing = sorted(p for st in stacks.values() for p in st.parts if p not in refs)
            if missing:
                raise CheckpointError(
                    f"{index} stacks tensors it does not list: {missing[:3]}",
                    hint="rebuild this stage: `--rebuild convert`",
                )
            return cls(root, refs, stacks)
        refs = {}
        for path in ckpt.weight_files(root):
            for key, meta in _header(path).items():
                refs[key] = TensorRef(path.name, key, meta["dtype"], tuple(meta["shape"]))
        return cls(root, refs)

    def names(self) -> list[str]:
        return list(dict.fromkeys([*self.refs, *self.stacks]))  # a stack may carry a stored tensor's name

    def __contains__(self, name: str) -> bool:
        return name in self.refs or name in self.stacks

    def shape(self, name: str) -> tuple[int, ...]:
        st = self.stacks.get(name)
        if st is None:
            return self.refs[name].shape
        if st.kind == "transpose":
            slabs, cols, rows = self.refs[st.parts[0]].shape
            return (slabs, rows, cols)
        if st.kind == "mxfp4":
            slabs, rows, groups, width = self.refs[st.parts[0]].shape
            return (slabs, rows, groups * width * 2)
        if st.kind == "regroup":
            return (st.interleave * sum(b - a for a, b in st.spans), self.refs[st.parts[0]].shape[1])
        rows, *rest = self.refs[st.parts[0]].shape
        return (len(st.parts) // st.interleave, rows * st.interleave, *rest)

    def files(self) -> list[str]:
        return sorted({r.file for r in self.refs.values()})

    def get(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        """One tensor, a fresh CPU copy (converted to `dtype` when given)."""
        if name in self.stacks:
            import torch

            return torch.cat(list(self.iter_rows(name, dtype)))
        return self._stored(name, dtype)

    def _stored(self, name: str, dtype=None, index: int | None = None) -> torch.Tensor:
        """A tensor as stored (not a stack's view of it); `index`: only its slab `index` along dim 0."""
        from safetensors import SafetensorError

        ref = self.refs[name]
        try:
            handle = self._handle(ref.file)
            tensor = handle.get_tensor(ref.key) if index is None else handle.get_slice(ref.key)[index : index + 1]
        except SafetensorError as exc:
            raise CheckpointError(f"corrupt safetensors file {self.root / ref.file}: {exc}", hint=_HINT) from None
        return tensor if dtype is None or tensor.dtype == dtype else tensor.to(dtype)

    def iter_rows(
        self, name: str, dtype: torch.dtype, rows: int | None = None, chunk_bytes: int = 8 << 20
    ) -> Iterator[torch.Tensor]:
        """The tensor (its first `rows` rows when given) in row blocks of about `chunk_bytes`, in `dtype`.

        Only one block is ever converted at a time, so a 2 GB embedding costs ~8 MB to stream. Blocks
        stay well under glibc's largest mmap threshold (32 MB), so their memory is reused from the heap:
        64 MB blocks were fresh mappings each, and writing the 0.6B shape's 2.4 GB cost 5.8 s of system
        time in page faults instead of 1.6 s.
        """
        from safetensors import SafetensorError

        if name in self.stacks and self.stacks[name].kind == "regroup":
            yield from self._regrouped(self.stacks[name], dtype, rows)
            return
        if name in self.stacks:  # one slab (expert) at a time
            st = self.stacks[name]
            slabs = self.shape(name)[0]
            for i in range(slabs if rows is None else min(rows, slabs)):
                yield self._slab(st, i, dtype)
            return
        ref = self.refs[name]
        total = ref.shape[0] if ref.shape else 1
        total = min(total, rows) if rows is not None else total
        if len(ref.shape) < 2:
            yield self.get(name, dtype)[:total] if ref.shape else self.get(name, dtype)
            return
        row_bytes = max(1, ref.nbytes // ref.shape[0] * 4 // _DTYPE_BYTES.get(ref.dtype, 4))
        step = max(1, chunk_bytes // row_bytes)
        try:
            sl = self._handle(ref.file).get_slice(ref.key)
            for start in range(0, total, step):
                yield sl[start : min(total, start + step)].to(dtype)
        except SafetensorError as exc:
            raise CheckpointError(f"corrupt safetensors file {self.root / ref.file}: {exc}", hint=_HINT) from None

    def _regrouped(self, st: Stack, dtype, rows: int | None) -> Iterator[torch.Tensor]:
        """A "regroup" stack's rows (its first `rows` when given), one span of one group at a time."""
        from safetensors import SafetensorError

        ref = self.refs[st.parts[0]]
        width = ref.shape[0] // st.interleave
        left = st.interleave * sum(b - a for a, b in st.spans) if rows is None else rows
        try:
            sl = self._handle(ref.file).get_slice(ref.key)
            for start, stop in st.spans:
                for g in range(st.interleave):
                    n = min(stop - start, left)
                    if n <= 0:
                        return
                    block = sl[g * width + start : g * width + start + n]
                    yield block if dtype is None else block.to(dtype)
                    left -= n
        except SafetensorError as exc:
            raise CheckpointError(f"corrupt safetensors file {self.root / ref.file}: {exc}", hint=_HINT) from None

    def _slab(self, st: Stack, i: int, dtype) -> torch.Tensor:
        import torch

        if st.kind == "transpose":
            return self._stored(st.parts[0], dtype, index=i).transpose(1, 2).contiguous()
        if st.kind == "mxfp4":
            return _mxfp4(self._stored(st.parts[0], index=i), self._stored(st.parts[1], index=i), dtype)
        group = [self._stored(p, dtype) for p in st.parts[i * st.interleave : (i + 1) * st.interleave]]
        rows, cols = group[0].shape
        return torch.stack(group, dim=1).reshape(1, rows * st.interleave, cols)

    def items(self, dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        for name in self.refs:
            yield name, self.get(name, dtype)

    def _handle(self, file: str):
        from safetensors import safe_open

        if file not in self._handles:
            self._handles[file] = safe_open(str(self.root / file), framework="pt", device="cpu")
        return self._handles[file]

    def close(self) -> None:
        self._handles.clear()


def _mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype) -> torch.Tensor:
    """Blocks [1, rows, groups, 16] and scales [1, rows, groups] to values [1, rows, groups * 32] (exact in
    float32: an E2M1 value times a power of two)."""
    import torch

    lut = torch.tensor(_FP4, dtype=torch.float32)
    codes = torch.stack((blocks & 0x0F, blocks >> 4), dim=-1).flatten(-2).long()  # low nibble first
    values = torch.ldexp(lut[codes], scales.to(torch.int32)[..., None] - 127)
    return values.flatten(-2).to(dtype or torch.float32)


def _header(path: Path) -> dict[str, Any]:
    raw = json.loads(ckpt.read_safetensors_header(path))
    raw.pop("__metadata__", None)
    return raw


def write_index(root: Path, entries: dict[str, tuple[str, str]], stacks: dict[str, Stack] | None = None) -> None:
    """weights.json: name -> (file, stored key); files are relative to `root`; `stacks` as in WeightStore."""
    data: dict[str, Any] = {
        "format": WEIGHTS_INDEX_FORMAT,
        "tensors": {name: {"file": f, "key": k} for name, (f, k) in sorted(entries.items())},
    }
    if stacks:
        data["stacks"] = {
            n: {"parts": list(s.parts), "interleave": s.interleave, "kind": s.kind}
            | ({"spans": [list(span) for span in s.spans]} if s.spans else {})
            for n, s in sorted(stacks.items())
        }
    (Path(root) / WEIGHTS_INDEX).write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")


def link_or_copy(src: Path, dst: Path) -> str:
    """Hard-link `src` to `dst` (no bytes copied); copy when linking is impossible. Returns "link" or "copy"."""
    src = Path(src).resolve()  # Hugging Face cache snapshots are symlinks to blobs
    try:
        os.link(src, dst)
        return "link"
    except OSError:  # another filesystem, or a filesystem/permission setting that forbids hard links
        shutil.copyfile(src, dst)
        return "copy"
