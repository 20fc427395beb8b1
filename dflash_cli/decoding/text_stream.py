"""Committed tokens -> text deltas for streaming, with stop strings.

Decoding the whole sequence so far (not token by token) keeps multi-byte characters and
tokenizer spacing intact. Text that could still turn into a stop string, or an incomplete
UTF-8 character, is held back until the next tokens decide it, so a client never receives text
that the stop string later cuts off.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable


class TextStream:
    def __init__(self, decode: Callable[[list[int]], str], stops: Iterable[str] = ()) -> None:
        self._decode = decode
        self.stops = [s for s in stops if s]
        self.tokens: list[int] = []
        self.text = ""  # the text so far, cut at a stop string once one appears
        self.sent = 0  # characters of `text` already handed out
        self.stopped = False  # a stop string appeared

    def push(self, new: list[int]) -> str:
        """Add committed tokens; return the text that is now safe to send."""
        if self.stopped:
            return ""
        self.tokens.extend(new)
        text = self._decode(self.tokens)
        cut = min((i for i in (text.find(s) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            self.text, self.stopped = text[:cut], True
            return self._take(len(self.text))
        self.text = text
        base = len(text.rstrip("\ufffd"))  # an incomplete multi-byte character: wait for the rest
        safe = base
        for s in self.stops:  # a tail that begins a stop string: wait for the next tokens to decide
            for k in range(min(len(s) - 1, base), 0, -1):
                if text.endswith(s[:k], 0, base):
                    safe = min(safe, base - k)
                    break
        return self._take(max(safe, self.sent))

    def finish(self) -> str:
        """Whatever was held back, once generation has ended."""
        return self._take(len(self.text))

    def _take(self, upto: int) -> str:
        delta = self.text[self.sent : upto]
        self.sent = max(self.sent, upto)
        return delta
