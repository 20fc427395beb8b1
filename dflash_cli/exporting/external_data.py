"""Write a graph's initializers into an external data file one tensor at a time.

Each initializer's bytes are produced on demand (read from the checkpoint and converted to the
export dtype), appended to `<graph>.onnx.data` and replaced by a reference, so at most one tensor
is in memory. Tensors already written by another graph (the draft's embedding and lm_head are the
target's) are referenced in that graph's data file instead of being written twice; two names for
one stored tensor (a tied lm_head) share one copy too.

A lean export (an int8/int4 ONNX Runtime build) writes no bytes for the checkpoint's weights: they
point at DEFERRED, a file that never exists, at offsets of their own, and the compile reads them from
the checkpoint (weight_sources.json) when it quantises or stores them. Such a graph cannot be run as
it is, and ONNX Runtime says so (the file is missing) rather than computing with wrong values.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from dflash_cli.cache.hashing import HashingWriter

ALIGNMENT = 65536  # large tensors start on a 64 KiB boundary, so runtimes can memory-map them
ALIGN_ABOVE = 1 << 20
INLINE_BELOW = 1024  # small constants stay in the graph: shape inference must read e.g. Unsqueeze axes
DEFERRED = "checkpoint.deferred"  # the location of a lean export's checkpoint weights (no such file)


@dataclass
class WrittenTensors:
    """Where each source tensor went: identity -> (data file name, offset, length)."""

    places: dict[Hashable, tuple[str, int, int]] = field(default_factory=dict)
    deferred_bytes: int = 0  # the next DEFERRED offset: every deferred tensor has a place of its own

    def defer(self, nbytes: int) -> tuple[str, int, int]:
        place = (DEFERRED, self.deferred_bytes, nbytes)
        self.deferred_bytes += nbytes
        return place


@dataclass(frozen=True)
class Initializer:
    name: str
    identity: Hashable | None  # same identity = same bytes (shareable); None = unique to this graph
    produce: Callable[[], Iterable]  # the tensor's bytes as buffers (numpy blocks), in order
    origin: dict | None = None  # checkpoint tensor it is converted from (weight_sources.py), if any


class DataFile:
    """One graph's external data file, appended to tensor by tensor and hashed on the way out
    (hashing.HashingWriter); large tensors start on an ALIGNMENT boundary."""

    def __init__(self, out_dir: Path, name: str, digest: bool = True) -> None:
        from dflash_cli.cache.hashing import HashingWriter

        self.name, self.offset = name, 0
        self._file: HashingWriter = HashingWriter(out_dir / name, digest=digest)

    def append(self, blocks: Iterable, nbytes: int, what: str) -> tuple[str, int, int]:
        """Write `blocks` (bytes or numpy blocks, `nbytes` in all); returns (file name, offset, length)."""
        if nbytes > ALIGN_ABOVE and self.offset % ALIGNMENT:
            pad = ALIGNMENT - self.offset % ALIGNMENT
            self._file.write(b"\0" * pad)
            self.offset += pad
        length = 0
        for block in blocks:
            self._file.write(block if isinstance(block, bytes) else memoryview(block).cast("B"))
            length += block.nbytes if not isinstance(block, bytes) else len(block)
        if length != nbytes:
            raise RuntimeError(f"{what}: wrote {length} bytes, expected {nbytes}")
        place = (self.name, self.offset, length)
        self.offset += length
        return place

    def close(self, ok: bool = True) -> None:
        """Finish the file (and record its digest) when `ok`."""
        self._file.close(ok=ok)


def write_initializers(
    model,
    out_dir: Path,
    data_name: str,
    sources: dict[str, Initializer],
    written: WrittenTensors,
    progress: Callable[[int, int, int], None] | None = None,
    digest: bool = True,
    defer: bool = False,
) -> int:
    """Stream every initializer of `model` (onnx_ir) into out_dir/data_name; returns bytes written.

    `sources` gives the producer for initializers whose value is not in the graph (weights traced on
    the meta device); other initializers are written from their own value. `digest=False`: not hashed
    (never published). `defer`: tensors with a checkpoint origin get a DEFERRED place instead of bytes;
    without it, a tensor an earlier graph deferred is written here after all.
    """
    import onnx_ir as ir

    inits = list(model.graph.initializers.values())
    data = DataFile(out_dir, data_name, digest=digest)
    ok = False
    try:
        for i, value in enumerate(inits):
            src = sources.get(value.name)
            if value.const_value.nbytes < INLINE_BELOW:
                if src is not None or isinstance(value.const_value, ir.LazyTensor):
                    value.const_value = ir.Tensor(value.const_value.numpy(), name=value.name)
                continue
            shared = src is not None and src.identity is not None
            place = written.places.get(src.identity) if shared else None
            if place is not None and place[0] == DEFERRED and not defer:
                place = data.append(src.produce(), value.const_value.nbytes, value.name)  # this graph runs as is
            elif place is None and defer and src is not None and src.origin is not None:
                place = written.defer(value.const_value.nbytes)
                if shared:
                    written.places[src.identity] = place
            elif place is None:
                blocks = src.produce() if src is not None else [value.const_value.tobytes()]
                place = data.append(blocks, value.const_value.nbytes, value.name)
                if shared:
                    written.places[src.identity] = place
            location, start, length = place
            old = value.const_value
            value.const_value = ir.ExternalTensor(
                location, start, length, old.dtype, shape=old.shape, name=value.name, base_dir=str(out_dir)
            )
            if progress is not None:
                progress(i + 1, len(inits), data.offset)
        ok = True
    finally:
        data.close(ok=ok)
    return data.offset
