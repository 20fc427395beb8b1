"""Several sequences per call on a QAIC program whose retained cache holds `full_batch_size` of them.

The program was compiled from a "_cb" graph (modeling/slot_cache.py): every call names each row's cache slot
in `batch_index`. Continuous batching (decoding/batching.py) hands `run` a list of (slot, feeds); calls of the
same shapes go in one program call when a specialization takes `full_batch_size` rows of them (verify blocks,
one-token steps), padded with rows that write only their slot's spare cache slot (position -1); any other
call (a prefill chunk) runs alone, as QEfficient runs prefill one sequence at a time. NOT RUN ON A CARD.
"""

from __future__ import annotations

import numpy as np

from dflash_cli.errors import BackendError


class QaicSlots:
    variable_length = False  # the program serves its specializations' lengths only; the loops pad to them

    def __init__(self, session, full_batch_size: int, ctx_len: int, prefill_len: int) -> None:
        if "batch_index" not in session.input_names:
            raise BackendError(
                f"the {session.name} program takes one sequence per call",
                hint="rebuild with --set compile.qaic.full_batch_size=N for continuous batching",
            )
        self.session, self.name = session, session.name
        self.slots, self.ctx_len, self.prefill_len = full_batch_size, ctx_len, prefill_len

    def run(self, slots: list[int], feeds: list[dict[str, np.ndarray]]) -> list[dict[str, np.ndarray]]:
        out: list = [None] * len(feeds)
        groups: dict[tuple, list[int]] = {}
        for j, f in enumerate(feeds):  # calls of equal shapes may share a program call
            groups.setdefault(tuple(sorted((k, np.shape(v)) for k, v in f.items())), []).append(j)
        for group in groups.values():
            together = len(group) > 1 and self._batched(feeds[group[0]])
            for part in [group] if together else [[j] for j in group]:
                for j, res in zip(part, self._call([slots[j] for j in part], [feeds[j] for j in part])):
                    out[j] = res
        return out

    def _batched(self, feeds: dict[str, np.ndarray]) -> bool:
        shapes = {k: [self.slots, *np.shape(v)[1:]] for k, v in feeds.items()}
        return self.session.serves({**shapes, "batch_index": [self.slots, 1]})

    def _call(self, slots: list[int], feeds: list[dict[str, np.ndarray]]) -> list[dict[str, np.ndarray]]:
        n = len(slots)
        rows = list(slots)
        if n > 1:  # pad to the specialization's rows with slots not in this call, writing only their spare slot
            rows += [s for s in range(self.slots) if s not in slots][: self.slots - n]
        stacked = {}
        for name in feeds[0]:
            parts = [np.asarray(f[name]) for f in feeds]
            pad = np.full_like(parts[0], -1 if name.endswith("position_ids") else 0)
            stacked[name] = np.concatenate(parts + [pad] * (len(rows) - n))
        stacked["batch_index"] = np.asarray(rows, np.int64)[:, None]
        res = self.session.run(stacked)
        return [{k: v[j : j + 1] for k, v in res.items()} for j in range(n)]
