"""Engine views that decode several requests at once (decoding/batching.py), and when a build cannot.

`batched_views(engine, n)` gives n copies of the engine (own tokenizer each) whose target and draft are
SlotSessions of one CallBatcher: a thread per request calls `view.generate(...)` as it would alone.
"""

from __future__ import annotations

import json
from typing import Any

from dflash_cli.decoding.batching import CallBatcher, SlotSession


def batching_refusal(engine: Any) -> str | None:
    """Why this build decodes one request at a time, or None when it can batch (maybe after `unchecked`'s
    check at start)."""
    from dflash_cli.backends.ort_kv_inplace import OrtInPlaceKvSession
    from dflash_cli.backends.ort_prefix import OrtPrefixSession

    if engine.images is not None:
        return "a vision-language target's calls carry one prompt's images"
    if engine.target.compiled_slots:
        if _full_batch(engine) < 2:
            return "this QAIC build's programs hold one sequence's cache (rebuild with compile.qaic.full_batch_size)"
        return None
    if not isinstance(engine.target, OrtInPlaceKvSession):
        return "the target is not the in-place-cache graph (compile.ort.fuse off, or its attention was not rewritten)"
    if _batch_dim(engine.target) != "batch":
        return "the target graph takes one sequence per call (built before batching: rebuild)"
    if not isinstance(engine.draft, OrtPrefixSession) or _batch_dim(engine.draft) != "batch":
        return "the draft's prefix-cache graph takes one sequence per call"
    checked = engine.compile_facts.get("batch_invariance")
    if checked is not None and "skipped" not in checked and not checked["equal"]:
        return "the build found a sequence's outputs changing with the others in its call (compile.json)"
    return None


def unchecked(engine: Any) -> str | None:
    """Why the build did not check batch invariance (its checks did not fit its memory budget), or None when
    it did. Serving then checks it on the sessions it opens anyway (`check_at_start`)."""
    if not engine.target.host_checked:
        return "a QAIC build is compiled without a card"
    checked = engine.compile_facts.get("batch_invariance")
    if checked is None:
        return "the graphs were above the build's memory budget"
    return checked.get("skipped")


def check_at_start(batcher: CallBatcher, engine: Any) -> dict:
    """The build's batch-invariance check, on the batched target `batched_views` opened (before any request:
    it writes the first slots' caches)."""
    from dflash_cli.backends.batch_invariance import check_target

    return check_target(batcher.graphs["target"], engine.block_size, engine.vocab_size)


def _batch_dim(session: Any):
    return session.inference_session.get_inputs()[0].shape[0]


def _full_batch(engine: Any) -> int:
    """The sequences a QAIC build's target program holds (compile.qaic.full_batch_size; 0: one-sequence graphs)."""
    info = json.loads((engine.compile_dir / "export.json").read_text())
    return info["graphs"].get("target_cb", {}).get("full_batch_size", 0)


def affordable_slots(engine: Any, slots: int) -> int:
    """At most `slots`, fewer where memory is short. Each slot past the first costs a session of its own (every
    batch size opens one: a copy of the target's weights as ONNX Runtime packs them, about 1.25x their bytes) and
    its sequence's K/V buffers (1.2 GB at the 4B shape's 4096 positions); together they may take half of the
    memory available now."""
    from dflash_cli.host.memory import available_bytes

    if engine.target.compiled_slots:  # the card's programs hold the caches they were compiled for
        return min(slots, _full_batch(engine))
    from dflash_cli.backends.ort_batched import PACKED_WEIGHTS

    kv = sum(a.nbytes for a in getattr(engine.target, "_arrays", {}).values())
    free, each = available_bytes(), max(1, int(PACKED_WEIGHTS * engine.weight_bytes["target"]) + kv)
    return slots if free is None else max(1, min(slots, 1 + (free // 2) // each))


def batched_views(engine: Any, slots: int) -> tuple[list[Any], CallBatcher]:
    """`slots` engine views sharing one CallBatcher (`batching_refusal` must have said None; `affordable_slots`
    says how many fit)."""
    from dflash_cli.backends.ort_batched import BatchedDraft, BatchedTarget

    info = json.loads((engine.compile_dir / "export.json").read_text())
    if engine.target.compiled_slots:
        from dflash_cli.qaic.slots import QaicSlots

        full = _full_batch(engine)
        graphs = {
            g: QaicSlots(getattr(engine, g), full, engine.ctx_len, engine.prefill_len) for g in ("target", "draft")
        }
        return _views(engine, slots, CallBatcher(graphs))
    target = BatchedTarget(
        engine.compile_dir / info["graphs"]["target_prefix"]["onnx"],
        engine.ctx_len,
        slots,
        one=engine.target.inference_session,  # the session already open serves calls of one sequence
        pad_single_rows=engine.target.pad_single_rows,
        **_settings(engine, "target_prefix", info),
    )
    for n in range(2, slots + 1):  # open now (seconds each), not in the middle of someone's request
        target.session(n)
    draft_path = engine.compile_dir / info["graphs"]["draft_prefix"]["onnx"]
    draft = BatchedDraft(draft_path, engine.ctx_len, slots, session=engine.draft.inference_session)
    return _views(engine, slots, CallBatcher({"target": target, "draft": draft}))


def _views(engine: Any, slots: int, batcher: CallBatcher) -> tuple[list[Any], CallBatcher]:
    views = [
        engine.with_sessions(SlotSession(batcher, "target", slot), SlotSession(batcher, "draft", slot))
        for slot in range(slots)
    ]
    return views, batcher


def _settings(engine: Any, graph: str, info: dict) -> dict:
    from dflash_cli.backends.ort import OrtSettings

    o = engine.settings.ort
    path = engine.compile_dir / info["graphs"][graph]["onnx"]
    tables = engine.shared_tables
    shared = tables.for_graph(path) if tables is not None else None
    return {
        "settings": OrtSettings(o.intra_op_threads, o.graph_optimization, o.provider, o.allow_spinning),
        "initializers": shared,
    }
