"""Logprobs in OpenAI's two response shapes: completions' parallel lists and chat's list of token objects.

A token's text is the tokenizer's decoding of that token alone (a piece of a multi-byte character decodes to
U+FFFD, as in vLLM), so in completions' {text: logprob} maps two alternatives may share a key: the likelier
stays. Every generated token is listed, a stop string's own tokens included.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from dflash_cli.decoding.logprobs import TokenLogprob


class _Texts:
    """decode([id]) once per id of one response."""

    def __init__(self, decode: Callable[[list[int]], str]) -> None:
        self._decode, self._seen = decode, {}

    def __call__(self, token: int) -> str:
        if token not in self._seen:
            self._seen[token] = self._decode([token])
        return self._seen[token]


def completion_logprobs(
    decode: Callable[[list[int]], str], tokens: list[int], entries: list[TokenLogprob | None], start: int = 0
) -> dict[str, Any]:
    """`tokens` (the prompt's first when echoed) and their entries (None where a token has no logprob: the
    prompt's first) -> {tokens, token_logprobs, top_logprobs, text_offset}, offsets into the choice's text (from
    `start`: a streamed chunk's first token's)."""
    text = _Texts(decode)
    pieces = [text(t) for t in tokens]
    offsets, at = [], start
    for piece in pieces:
        offsets.append(at)
        at += len(piece)
    return {
        "tokens": pieces,
        "token_logprobs": [None if e is None else e.logprob for e in entries],
        "top_logprobs": [None if e is None else _by_text(text, e) for e in entries],
        "text_offset": offsets,
    }


def _by_text(text: _Texts, e: TokenLogprob) -> dict[str, float]:
    """{text: logprob}, likeliest first; tokens with the same text (pieces of characters) keep the likeliest's."""
    top: dict[str, float] = {}
    for t, lp in e.top:
        top.setdefault(text(t), lp)
    return top


def chat_logprobs(decode: Callable[[list[int]], str], entries: list[TokenLogprob]) -> dict[str, Any]:
    """{"content": [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}]}"""
    text = _Texts(decode)

    def item(token: int, logprob: float) -> dict[str, Any]:
        piece = text(token)
        return {"token": piece, "logprob": logprob, "bytes": list(piece.encode("utf-8"))}

    content = [{**item(e.token, e.logprob), "top_logprobs": [item(t, lp) for t, lp in e.top]} for e in entries]
    return {"content": content, "refusal": None}
