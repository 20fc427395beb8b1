"""A scripted stand-in for dflash_cli.decoding.engine.Engine, shared by the bench tests.

Tokens depend only on the prompt ids, so every lossless mode returns plain's tokens; DFlash and
prompt lookup replay scripted accept lengths and timings. `generate` calls are counted for resume tests.
"""

from __future__ import annotations

from types import SimpleNamespace

from dflash_cli.decoding.result import GenerationResult


class FakeEngine:
    def __init__(
        self,
        *,
        block_size: int = 4,
        dflash_accepts: tuple[int, ...] = (4, 3, 1, 2),
        lookup_accepts: tuple[int, ...] = (1, 2),
        mismatch: dict[str, int] | None = None,  # sample-independent: {"dflash": position}
        interrupt_after: int | None = None,  # raise KeyboardInterrupt at this generate call (0-based)
        chat_template: str | None = None,
        stop_token: int | None = None,  # end every generation with this token (eos)
    ) -> None:
        self.tokenizer = SimpleNamespace(chat_template=chat_template)
        self.block_size = block_size
        self.ctx_len = 1024
        self.eos_token_ids = [0]
        self.recipe_name = "fake"
        self.artifact_keys = {"convert": "k1", "export": "k2"}
        self.provider = "CPUExecutionProvider"
        self.weight_bytes = {"target": 2_000_000_000, "draft": 500_000_000}
        self.accepts = {"dflash": dflash_accepts, "lookup": lookup_accepts}
        self.mismatch = mismatch or {}
        self.interrupt_after = interrupt_after
        self.stop_token = stop_token
        self.calls: list[tuple[tuple[int, ...], str]] = []
        self.prompts: list[object] = []
        self.step_time_calls = 0

    # -- Engine contract -------------------------------------------------------------------------

    def encode_prompt(self, prompt: str | list[dict]) -> list[int]:
        self.prompts.append(prompt)
        text = prompt if isinstance(prompt, str) else "|".join(f"{m['role']}:{m['content']}" for m in prompt)
        return [1 + (ord(c) % 50) for c in text]

    def decode(self, ids: list[int]) -> str:
        return " ".join(str(i) for i in ids)

    def generate(
        self,
        prompt_ids: list[int],
        *,
        mode: str,
        max_new_tokens: int,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        seed: int = 0,
        on_commit=None,
    ) -> GenerationResult:
        if self.interrupt_after is not None and len(self.calls) >= self.interrupt_after:
            raise KeyboardInterrupt
        self.calls.append((tuple(prompt_ids), mode))
        base = sum(prompt_ids)
        tokens = [(base + 7 * i) % 97 + 1 for i in range(max_new_tokens)]
        if self.stop_token is not None:
            tokens[-1] = self.stop_token
        if mode in self.mismatch:
            tokens[self.mismatch[mode]] += 1
        decode_tokens = len(tokens) - 1
        if mode == "plain":
            return GenerationResult(
                mode="plain",
                prompt_tokens=len(prompt_ids),
                tokens=tokens,
                block_size=1,
                prefill_s=0.010,
                decode_s=0.002 * decode_tokens,
                target_calls=decode_tokens,
                target_s=0.0018 * decode_tokens,
            )
        accepts = _script(self.accepts[mode], decode_tokens)
        steps = len(accepts)
        return GenerationResult(
            mode=mode,
            prompt_tokens=len(prompt_ids),
            tokens=tokens,
            accept_lengths=accepts,
            block_size=self.block_size,
            prefill_s=0.012,
            decode_s=0.003 * steps,
            target_calls=steps,
            target_s=0.002 * steps,
            draft_calls=steps if mode == "dflash" else 0,
            draft_s=0.0005 * steps if mode == "dflash" else 0.0,
        )

    def step_times(self, repeats: int = 20) -> dict[str, float]:
        self.step_time_calls += 1
        return {"t1": 0.002, "t_verify": 0.0025, "t_draft": 0.0005}


def _script(pattern: tuple[int, ...], total: int) -> list[int]:
    """Accept lengths cycling through `pattern` that commit exactly `total` tokens."""
    out, left, i = [], total, 0
    while left > 0:
        a = min(pattern[i % len(pattern)], left)
        out.append(a)
        left -= a
        i += 1
    return out
