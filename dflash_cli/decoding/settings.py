"""The recipe's settings that decoding and serving act on, read once when the engine opens.

Decoding and serving read `engine.settings` (a frozen DecodeSettings), never `engine.recipe`: a setting
such as `run.verify` goes from where the recipe parses it (recipe/schema.py) to here, and from here to the one
place that acts on it. `engine.recipe` stays for reporting (bench reads it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class DecodeSettings:
    family: str  # the target's family: its chat template's switches (families/)
    backend: str  # compile.backend: which sessions the engine opens (decoding/sessions.py)
    ort: Any  # compile.ort (frozen): how ONNX Runtime sessions are opened
    verify: str  # run.verify: "auto" (verify as far as worth it, decoding/verify_length.py) or "block"
    chat_template: bool  # run.chat_template: a text prompt goes through the tokenizer's chat template
    enable_thinking: bool  # run.enable_thinking
    reasoning_effort: str | None  # run.reasoning_effort (gpt-oss's harmony system line)
    request_defaults: Any  # run (frozen): what a served request leaves out (max tokens, sampling, stop strings)
    allowed_local_media_path: str | None  # serve.allowed_local_media_path: where chat requests may name images

    @classmethod
    def from_recipe(cls, recipe: Any) -> DecodeSettings:
        run = recipe.run
        return cls(
            family=recipe.family,
            backend=recipe.compile.backend,
            ort=recipe.compile.ort,
            verify=run.verify,
            chat_template=run.chat_template,
            enable_thinking=run.enable_thinking,
            reasoning_effort=run.reasoning_effort,
            request_defaults=run,
            allowed_local_media_path=recipe.serve.allowed_local_media_path,
        )
