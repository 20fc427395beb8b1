"""A function run in a daemon thread whose result or exception is collected later."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any


class Background:
    """`work()` in a daemon thread; `result()` waits for it and returns its value or raises its exception."""

    def __init__(self, work: Callable[[], Any], name: str) -> None:
        self._value: Any = None
        self._error: BaseException | None = None

        def run() -> None:
            try:
                self._value = work()
            except BaseException as exc:  # noqa: BLE001 - handed to whoever asks for the result
                self._error = exc

        self._thread = threading.Thread(target=run, name=name, daemon=True)
        self._thread.start()

    def wait(self) -> None:
        self._thread.join()

    def result(self) -> Any:
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._value
