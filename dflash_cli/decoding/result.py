"""What one generation returns: tokens, per-step acceptance and timings (decode excludes prefill)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from dflash_cli.decoding.logprobs import TokenLogprob


@dataclass
class GenerationResult:
    mode: str  # a name in decoding/modes.py MODES: "plain" | "dflash" | "lookup" | "hybrid"
    prompt_tokens: int
    tokens: list[int]  # newly generated token ids (stop token included if hit)
    accept_lengths: list[int] = field(default_factory=list)  # tokens committed per verify step, bonus included
    block_size: int = 1
    prefill_s: float = 0.0  # time to first token: prefill and the first token
    decode_s: float = 0.0  # everything after the first token
    target_calls: int = 0  # decode-phase target (verify or plain step) calls
    target_s: float = 0.0  # seconds inside decode-phase target session calls
    draft_calls: int = 0
    draft_s: float = 0.0  # seconds inside draft session calls (incl. context updates)
    step_sources: list[str] = field(default_factory=list)  # hybrid: who proposed each verify step
    verify_lengths: list[int] = field(default_factory=list)  # tokens each verify checked (proposal + 1)
    stopped: str = "length"  # "length" | "stop_token" | whatever on_commit returned ("stop_string", ...)
    logprobs: list[TokenLogprob] | None = None  # per new token, where asked for (decoding/logprobs.py)
    prompt_logprobs: list[TokenLogprob | None] | None = None  # per prompt token (the first: None), where asked

    @property
    def new_tokens(self) -> int:
        return len(self.tokens)

    @property
    def tau(self) -> float:
        """Mean tokens committed per verify step (bonus included); 1.0 for plain decoding."""
        return sum(self.accept_lengths) / len(self.accept_lengths) if self.accept_lengths else 1.0

    @property
    def decode_tokens(self) -> int:
        # The first token comes out of prefill; decode produces the rest.
        return max(0, len(self.tokens) - 1)

    @property
    def decode_tokens_per_s(self) -> float:
        return self.decode_tokens / self.decode_s if self.decode_s > 0 else 0.0

    @property
    def time_per_output_token(self) -> float:
        return self.decode_s / self.decode_tokens if self.decode_tokens else 0.0

    @property
    def loop_overhead_s(self) -> float:
        """Decode wall time not spent inside session calls (Python loop, sampling, bookkeeping)."""
        return max(0.0, self.decode_s - self.target_s - self.draft_s)

    def to_dict(self) -> dict:
        d = asdict(self)
        d.update(tau=self.tau, new_tokens=self.new_tokens, decode_tokens_per_s=self.decode_tokens_per_s)
        return d
