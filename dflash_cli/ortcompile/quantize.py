"""Weight-only int8 / int4 for ONNX Runtime, one weight at a time.

Every MatMul whose weight is a constant (an initializer, or `Transpose` of one, as the exporter
writes `nn.Linear`) becomes ONNX Runtime's `MatMulNBits`: block-wise scales along K, activations
untouched; the embedding's Gather becomes `GatherBlockQuantized` (ortcompile/quantize_tables.py). A
position's output then depends only on its own row, so a verify block gives each position exactly
what a shorter call would, and greedy speculative decoding stays lossless (per-tensor dynamic
activation scales, the old int8, broke that).

Nothing is loaded whole: the graph is read without its external data, each weight is read from
the checkpoint it was exported from when unchanged (exporting/weight_sources.py), else from the
export's data file (memory-mapped), quantised and appended to `<graph>.onnx.q.data`. The weights
that stay as they are (norms) keep pointing at the export's data file, which the compile
artifact hard-links rather than copies; a lean export has none of them (exporting/external_data.py),
so they are read from the checkpoint and appended to `.q.data` as they are.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from dflash_cli.exporting.onnx_data import is_deferred, prefetch, read_initializer
from dflash_cli.ortcompile.quantize_moe import quantize_experts
from dflash_cli.ortcompile.quantize_tables import quantize_tables

ALIGNMENT = 65536
SPLIT_ROWS = 2048  # weights with at least twice this many output rows are quantised in two halves at once
STACKED_WEIGHTS_KEY = "dflash.stacked_weights"  # on a stacked MatMulNBits: its parts' weight names, in Split order


@dataclass(frozen=True)
class QuantResult:
    quantized: int  # MatMuls rewritten
    weight_bytes: int  # bytes written to the .q.data file
    stacked: int = 0  # groups of projections sharing an input, now one MatMulNBits each
    experts: int = 0  # MoE nodes now QMoE (ortcompile/quantize_moe.py)


def quantize_graph(
    src_onnx: Path,
    dst_onnx: Path,
    *,
    bits: int,
    block_size: int,
    accuracy_level: int = 0,
    progress: Callable[[str], None] = lambda m: None,
    done: dict | None = None,
    fuse_siblings: bool = True,
    source=None,
) -> QuantResult:
    """Write dst_onnx (graph) + dst_onnx.q.data (quantised weights); other weights keep src's data file.

    dst_onnx must be in a directory where src's external data files are reachable under the same names.
    `done` carries the quantised tensors of graphs compiled before, by source bytes: a weight the
    draft shares with the target (its lm_head) points at the target's .q.data instead of a second copy.
    `source` (exporting.weight_sources.SourceReader) reads a weight from the checkpoint it was exported
    from (the same values, often half the bytes); weights it cannot read come from the export.
    """
    import onnx
    from onnx import helper

    done = {} if done is None else done

    model = onnx.load(str(src_onnx), load_external_data=False)
    graph = model.graph
    inits = {t.name: t for t in graph.initializer}
    producers = {out: n for n in graph.node for out in n.output}
    consumers: dict[str, list] = {}
    for n in graph.node:
        for i in n.input:
            consumers.setdefault(i, []).append(n)

    # weight initializer name -> (initializer, transposed?, Transpose node or None, [MatMul nodes])
    plans: dict[str, tuple] = {}
    for node in graph.node:
        if node.op_type != "MatMul" or len(node.input) != 2:
            continue
        b = node.input[1]
        if b in inits and len(inits[b].dims) == 2:
            plans.setdefault(b, (inits[b], False, None, []))[3].append(node)
            continue
        t = producers.get(b)
        if (
            t is not None
            and t.op_type == "Transpose"
            and t.input[0] in inits
            and len(inits[t.input[0]].dims) == 2
            and list(helper.get_attribute_value(a) for a in t.attribute if a.name == "perm") in ([[1, 0]], [])
            and all(c.op_type == "MatMul" and c.input[1] == b for c in consumers.get(b, []))
        ):
            # the draft's k_proj / v_proj feed two MatMuls (context and block): quantised once, shared
            plans.setdefault(t.input[0], (inits[t.input[0]], True, t, []))[3].append(node)

    # Projections that read the same activation (q/k/v, gate/up) become ONE MatMulNBits over their
    # weights stacked along N, then a Split into the original outputs: one kernel call instead of three
    # (or two). Each output row is quantised on its own, so the stacked weight holds exactly the rows
    # the separate ones would (a 0.6B int4 decode step: ~10% faster, measured).
    siblings: dict[str, list[str]] = {}
    for name, (_, _, _, matmuls) in plans.items():
        if len(matmuls) == 1 and fuse_siblings:  # a weight read by two MatMuls (the draft's k/v) stays alone
            siblings.setdefault(matmuls[0].input[0], []).append(name)
    group_of = {n: names for names in siblings.values() if len(names) > 1 for n in names}

    data_name = dst_onnx.name + ".q.data"
    removed_nodes: set[int] = set()
    expanded: dict[int, list] = {}  # id(node) -> the nodes that take its place
    new_inits = []
    offset = 0
    rewritten = 0
    grouped = 0

    from dflash_cli.hashing import HashingWriter

    # Hashed on the way out: publish does not read it back.
    with HashingWriter(dst_onnx.parent / data_name) as f:

        def write(base: str, packed: np.ndarray, scales: np.ndarray | None = None) -> tuple[list, list]:
            """Append the arrays (`scales` named base + ".scales"); returns their tensors and places."""
            nonlocal offset
            tensors, places = [], []
            for name, arr in ((base, packed), (base + ".scales", scales))[: 1 if scales is None else 2]:
                pad = (-offset) % ALIGNMENT if arr.nbytes > ALIGNMENT else 0
                f.write(b"\0" * pad)
                offset += pad
                f.write(np.ascontiguousarray(arr))  # a fresh array nothing changes afterwards
                place = (helper.np_dtype_to_tensor_dtype(arr.dtype), tuple(arr.shape), data_name, offset, arr.nbytes)
                tensors.append(_external_tensor(name, *place))
                places.append((name, place))
                offset += arr.nbytes
            return tensors, places

        def quantised(name: str) -> tuple[np.ndarray, np.ndarray, int, int]:
            weight, transposed, _, _ = plans[name]
            w = source.read(weight) if source is not None else None
            if w is None:
                w = read_initializer(weight, src_onnx.parent)
            if w.dtype not in (np.float32, np.float16):
                w = w.astype(np.float32)
            if transposed:  # [N, K], nn.Linear's layout
                N, K = w.shape
                packed, scales = _quantize_rows(w, bits, block_size)
            else:
                K, N = w.shape
                packed, scales = _quantize(np.ascontiguousarray(w), bits, block_size)
            return packed, scales, K, N

        def report(count: int) -> None:
            progress(f"{src_onnx.name}: {count}/{len(plans)} MatMul weights to int{bits}, {offset / 1e9:.2f} GB")

        handled: set[str] = set()
        order = list(plans)
        for at, (wname, (weight, transposed, tnode, matmuls)) in enumerate(plans.items()):
            if wname in handled:
                continue
            # The disk reads the next weights while this one is quantised (the export's data rarely
            # fits the page cache at 8B: 34 GB of fp32).
            for ahead in group_of.get(order[at + 1], [order[at + 1]]) if at + 1 < len(order) else []:
                if source is None or not source.prefetch(plans[ahead][0]):
                    prefetch(plans[ahead][0], src_onnx.parent)
            group = group_of.get(wname)
            if group:
                # The prefix-cache graph stacks the same source bytes: it points at the first graph's copy.
                ids = tuple(_source_identity(plans[n][0], src_onnx.parent, plans[n][1]) for n in group)
                key = ("stacked", ids) if None not in ids else None
                if key is not None and key in done:
                    K, widths, places = done[key]
                    tensors = [_external_tensor(name, *place) for name, place in places]
                else:
                    parts = [quantised(n) for n in group]
                    K, widths = parts[0][2], [p[3] for p in parts]
                    tensors, places = write(
                        f"{wname}+{len(group) - 1}.w{bits}",
                        np.concatenate([p[0] for p in parts]),
                        np.concatenate([p[1] for p in parts]),
                    )
                    del parts
                    if key is not None:
                        done[key] = (K, widths, places)
                nodes = [plans[n][3][0] for n in group]
                stacked, split_sizes = _stacked(nodes, group, widths, tensors, K, bits, block_size, accuracy_level)
                new_inits += [*tensors, split_sizes]
                expanded[id(nodes[0])] = stacked
                removed_nodes |= {id(n) for n in nodes[1:]}
                removed_nodes |= {id(plans[n][2]) for n in group if plans[n][2] is not None}
                handled |= set(group)
                rewritten += len(group)
                grouped += 1
                report(len(handled))
                continue
            identity = _source_identity(weight, src_onnx.parent, transposed)
            if identity is not None and identity in done:
                K, N, places = done[identity]
                tensors = [_external_tensor(name, *place) for name, place in places]
            else:
                packed, scales, K, N = quantised(wname)
                tensors, places = write(f"{weight.name}.w{bits}", packed, scales)
                del packed, scales
                if identity is not None:
                    done[identity] = (K, N, places)
            new_inits += tensors
            _rewrite(matmuls, tensors, K, N, bits, block_size, accuracy_level)
            rewritten += len(matmuls)
            if tnode is not None:
                removed_nodes.add(id(tnode))
            handled.add(wname)
            if len(handled) % 16 == 0 or len(handled) == len(plans):
                report(len(handled))

        # MoE nodes to QMoE, embedding tables to GatherBlockQuantized: each returns {id(node): (its
        # replacement, new tensors)} and the names of the float tensors it replaces
        shared = {
            "bits": bits,
            "block_size": block_size,
            "done": done,
            "identity": lambda t: _source_identity(t, src_onnx.parent, False),
            "source": source,
            "progress": progress,
        }
        moe, moe_weights = quantize_experts(
            graph, inits, write, src_onnx.parent, accuracy_level=accuracy_level, quantize_kn=_quantize, **shared
        )
        gathers, tables = quantize_tables(
            graph,
            inits,
            write,
            src_onnx.parent,
            quantize_rows=_quantize_rows,
            external_tensor=_external_tensor,
            **shared,
        )
        replaced = moe_weights | tables
        for node_id, (qnode, tensors) in (moe | gathers).items():
            expanded[node_id] = [qnode]
            new_inits += tensors

        keep_nodes = [m for n in graph.node if id(n) not in removed_nodes for m in expanded.get(id(n), [n])]
        still_used = {i for n in keep_nodes for i in n.input}
        keep_inits = [
            t
            for t in graph.initializer
            if (t.name not in plans and t.name not in replaced and not is_deferred(t)) or t.name in still_used
        ]
        # A lean export's weights that stay as they are (norms): stored here, from the checkpoint.
        for i, t in enumerate(keep_inits):
            if is_deferred(t):
                key = ("kept", _source_identity(t, src_onnx.parent, False))
                if key not in done:
                    values = source.read(t) if source is not None else None
                    done[key] = write(t.name, read_initializer(t, src_onnx.parent) if values is None else values)[1]
                ((_, place),) = done[key]
                keep_inits[i] = _external_tensor(t.name, *place)
    del graph.node[:]
    graph.node.extend(keep_nodes)
    del graph.initializer[:]
    graph.initializer.extend(keep_inits + new_inits)
    if not any(o.domain == "com.microsoft" for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    onnx.save_model(model, str(dst_onnx))
    return QuantResult(rewritten, offset, grouped, len(moe))


def _quantize_rows(w: np.ndarray, bits: int, block_size: int) -> tuple[np.ndarray, np.ndarray]:
    """`_quantize` of w.T for w [N, K]: large weights as two halves of N on two threads (the quantiser
    releases the GIL: 1.07 s instead of 1.57 s for a 151936 x 1024 lm_head here). Each output row is
    quantised on its own, so the halves concatenate to exactly the whole."""
    N = w.shape[0]
    if N < 2 * SPLIT_ROWS:
        return _quantize(_transposed(w), bits, block_size)
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(2) as pool:
        halves = list(pool.map(lambda part: _quantize(_transposed(part), bits, block_size), (w[: N // 2], w[N // 2 :])))
    return np.concatenate([h[0] for h in halves]), np.concatenate([h[1] for h in halves])


def _transposed(w: np.ndarray) -> np.ndarray:
    """w.T made contiguous: PyTorch's blocked, threaded copy is ~7x numpy's on a 151936 x 1024 lm_head
    here (0.6 s vs 4.4 s), and an 8B target has 32 GB of such weights."""
    import warnings

    import torch

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a read-only memory map: torch only reads it here
        return torch.from_numpy(w).t().contiguous().numpy()


def _source_identity(weight, base_dir: Path, transposed: bool):
    """The stored bytes a weight initializer points at (file, offset, length), or None when inline."""
    import os

    from onnx import TensorProto

    from dflash_cli.exporting.onnx_data import external_info

    if weight.data_location != TensorProto.EXTERNAL:
        return None
    info = external_info(weight)
    where = os.path.realpath(base_dir / info["location"])
    return (where, int(info.get("offset", 0)), int(info.get("length", 0)), transposed)


def _external_tensor(name: str, data_type: int, shape: tuple, location: str, offset: int, length: int):
    from onnx import TensorProto

    t = TensorProto(name=name, data_type=data_type)
    t.dims.extend(shape)
    t.data_location = TensorProto.EXTERNAL
    for key, value in (("location", location), ("offset", str(offset)), ("length", str(length))):
        e = t.external_data.add()
        e.key, e.value = key, value
    return t


def _rewrite(matmuls, tensors, K: int, N: int, bits: int, block_size: int, accuracy_level: int) -> None:
    for node in matmuls:
        name = (node.name or node.output[0]) + "_nbits"
        node.CopyFrom(
            _nbits_node(node.input[0], list(node.output), name, tensors, K, N, bits, block_size, accuracy_level)
        )


def _nbits_node(x: str, outputs: list[str], name: str, tensors, K, N, bits, block_size, accuracy_level):
    from onnx import helper

    return helper.make_node(
        "MatMulNBits",
        [x, tensors[0].name, tensors[1].name],
        outputs,
        name=name,
        domain="com.microsoft",
        K=K,
        N=N,
        bits=bits,
        block_size=block_size,
        **({"accuracy_level": accuracy_level} if accuracy_level else {}),
    )


def _stacked(
    nodes, weights: list[str], widths: list[int], tensors, K: int, bits: int, block_size: int, accuracy_level: int
):
    """One MatMulNBits over the stacked weights and a Split back into the MatMuls' own outputs; the
    stacked node names its parts (STACKED_WEIGHTS_KEY) so later rewrites can still tell q from k from v."""
    from onnx import helper, numpy_helper

    out = nodes[0].output[0] + ".stacked"
    name = (nodes[0].name or nodes[0].output[0]) + "_stacked_nbits"
    node = _nbits_node(nodes[0].input[0], [out], name, tensors, K, sum(widths), bits, block_size, accuracy_level)
    entry = node.metadata_props.add()
    entry.key, entry.value = STACKED_WEIGHTS_KEY, ",".join(weights)
    sizes = numpy_helper.from_array(np.array(widths, np.int64), out + ".sizes")
    split = helper.make_node("Split", [out, sizes.name], [n.output[0] for n in nodes], name=out + "_split", axis=-1)
    return [node, split], sizes


def _quantize(kn: np.ndarray, bits: int, block_size: int) -> tuple[np.ndarray, np.ndarray]:
    """ONNX Runtime's own block quantiser (symmetric): packed [N, blocks, blob], scales [N, blocks]."""
    from onnxruntime.capi._pybind_state import quantize_matmul_4bits, quantize_matmul_8bits

    K, N = kn.shape
    k_blocks = (K + block_size - 1) // block_size
    if K % block_size:
        kn = np.pad(kn, ((0, k_blocks * block_size - K), (0, 0)))
    blob = block_size * bits // 8
    packed = np.zeros((N, k_blocks, blob), dtype=np.uint8)
    scales = np.zeros((N, k_blocks), dtype=kn.dtype)
    zero_points = np.zeros((N, (k_blocks * bits + 7) // 8), dtype=np.uint8)
    fn = quantize_matmul_4bits if bits == 4 else quantize_matmul_8bits
    fn(packed, kn, scales, zero_points, block_size, N, K, True)
    return packed, scales
