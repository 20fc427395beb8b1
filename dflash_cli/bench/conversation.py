"""Prompts for multi-turn samples: each user turn follows the model's own earlier replies.

Turn k is encoded from the previous user turns and replies. With a chat template the engine
gets a messages list; without one the turns and replies are joined by blank lines. Every mode
gets the same prompt ids for a turn (the runner feeds one mode's replies as the shared history).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

History = list[tuple[str, str]]  # (user message, model reply) for each finished turn

TURN_SEPARATOR = "\n\n"


def uses_chat_messages(engine: Any) -> bool:
    """Whether prompts go through a chat template: the engine's own flag, else the tokenizer's template."""
    flag = getattr(engine, "uses_chat_template", None)
    if flag is not None:
        return bool(flag)
    return bool(getattr(getattr(engine, "tokenizer", None), "chat_template", None))


def encode_turn(engine: Any, history: History, user: str) -> list[int]:
    """Prompt ids for `user` after `history`; a first turn is passed as plain text like `dflash run`."""
    if not history:
        return engine.encode_prompt(user)
    if uses_chat_messages(engine):
        messages: list[dict[str, str]] = []
        for past_user, reply in history:
            messages.append({"role": "user", "content": past_user})
            messages.append({"role": "assistant", "content": reply})
        messages.append({"role": "user", "content": user})
        return engine.encode_prompt(messages)
    parts = [text for pair in history for text in pair]
    return engine.encode_prompt(TURN_SEPARATOR.join([*parts, user]))


def reply_text(engine: Any, tokens: Sequence[int]) -> str:
    """The reply as history text: a trailing stop token is the end of the turn, not content."""
    ids = list(tokens)
    stops = set(getattr(engine, "eos_token_ids", ()) or ())
    while ids and ids[-1] in stops:
        ids.pop()
    return engine.decode(ids)
