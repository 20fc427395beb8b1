"""Write a graph's initializers into an external data file one tensor at a time.

Each initializer's bytes are produced on demand (read from the checkpoint and converted to the
export dtype), appended to `<graph>.onnx.data` and replaced by a reference, so at most one tensor
is in memory. Tensors already written by another graph (the draft's embedding and lm_head are the
target's) are referenced in that graph's data file instead of being written twice; two names for
one stored tensor (a tied lm_head) share one copy too.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

ALIGNMENT = 65536  # large tensors start on a 64 KiB boundary, so runtimes can memory-map them
ALIGN_ABOVE = 1 << 20
INLINE_BELOW = 1024  # small constants stay in the graph: shape inference must read e.g. Unsqueeze axes


@dataclass
class WrittenTensors:
    """Where each source tensor went: identity -> (data file name, offset, length)."""

    places: dict[Hashable, tuple[str, int, int]] = field(default_factory=dict)


@dataclass(frozen=True)
class Initializer:
    name: str
    identity: Hashable | None  # same identity = same bytes (shareable); None = unique to this graph
    produce: Callable[[], Iterable]  # the tensor's bytes as buffers (numpy blocks), in order
    origin: dict | None = None  # checkpoint tensor it is converted from (weight_sources.py), if any


def write_initializers(
    model,
    out_dir: Path,
    data_name: str,
    sources: dict[str, Initializer],
    written: WrittenTensors,
    progress: Callable[[int, int, int], None] | None = None,
    direct: bool = True,
) -> int:
    """Stream every initializer of `model` (onnx_ir) into out_dir/data_name; returns bytes written.

    `sources` gives the producer for initializers whose value is not in the graph (weights traced on
    the meta device); other initializers are written from their own value. `direct=False` keeps the
    file in the page cache (read back soon); see dflash_cli/direct_file.py.
    """
    import onnx_ir as ir

    from dflash_cli.cache import HashingWriter

    inits = list(model.graph.initializers.values())
    offset = 0
    with HashingWriter(out_dir / data_name, direct=direct) as f:
        for i, value in enumerate(inits):
            src = sources.get(value.name)
            if value.const_value.nbytes < INLINE_BELOW:
                if src is not None or isinstance(value.const_value, ir.LazyTensor):
                    value.const_value = ir.Tensor(value.const_value.numpy(), name=value.name)
                continue
            place = written.places.get(src.identity) if src is not None and src.identity is not None else None
            if place is None:
                if value.const_value.nbytes > ALIGN_ABOVE and offset % ALIGNMENT:
                    pad = ALIGNMENT - offset % ALIGNMENT
                    f.write(b"\0" * pad)
                    offset += pad
                blocks = src.produce() if src is not None else [value.const_value.tobytes()]
                length = 0
                for block in blocks:
                    f.write(block if isinstance(block, bytes) else memoryview(block).cast("B"))
                    length += block.nbytes if not isinstance(block, bytes) else len(block)
                if length != value.const_value.nbytes:
                    raise RuntimeError(f"{value.name}: wrote {length} bytes, expected {value.const_value.nbytes}")
                place = (data_name, offset, length)
                offset += length
                if src is not None and src.identity is not None:
                    written.places[src.identity] = place
            location, start, length = place
            old = value.const_value
            value.const_value = ir.ExternalTensor(
                location, start, length, old.dtype, shape=old.shape, name=value.name, base_dir=str(out_dir)
            )
            if progress is not None:
                progress(i + 1, len(inits), offset)
    return offset
