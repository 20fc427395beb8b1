"""Take each traced template as it arrives and start the validation twin from it at once.

The export writes the first graph's weights (most of the bytes) while another process traces the
templates (trace_worker.py). Were the templates taken only when the writing loop reaches them, the
twin's checks, which need one (twin_graphs.py), would start after those gigabytes and end last: on
the 0.6B-shaped pair ~3 s alone at the end of the export. A thread takes them as they come instead
and grows each static graph's twin then, so its checks run beside the writing.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any


class TemplateArrivals:
    """`get(i)` gives job i's (template or None, whether `hooks[i]` has seen it), in order."""

    def __init__(self, worker, jobs: Sequence[Any], hooks: dict[int, Callable[[Any, dict], None]]) -> None:
        self._results: dict[int, tuple[Any, bool]] = {}
        self._arrived = threading.Condition()
        self._thread = threading.Thread(
            target=self._take_all, args=(worker, jobs, hooks), name="dflash-templates", daemon=True
        )
        self._thread.start()

    def _take_all(self, worker, jobs: Sequence[Any], hooks: dict[int, Callable[[Any, dict], None]]) -> None:
        for i, job in enumerate(jobs):
            got, hooked = None, False
            try:
                got = worker.take(i, job.sources, 0.0)
                if got is not None and i in hooks:
                    hooks[i](got[0], got[1])  # clones the template; the writing loop gets it after this
                    hooked = True
            except Exception:  # noqa: BLE001 - the writing loop then traces (and hooks) the graph itself
                got, hooked = None, False
            with self._arrived:
                self._results[i] = (got, hooked)
                self._arrived.notify_all()

    def get(self, i: int) -> tuple[Any, bool]:
        with self._arrived:
            self._arrived.wait_for(lambda: i in self._results)
            return self._results.pop(i)
