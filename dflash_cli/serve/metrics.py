"""Server counters in the Prometheus text format, named as vLLM names them.

Spec-decode counters follow vLLM's definitions so dashboards and `bench` scripts written for vLLM
read them unchanged: one *draft* is one verify step, it proposes block_size - 1 *draft tokens*,
*accepted tokens* are the draft tokens the target confirmed (the target's own bonus token is not
counted), and `..._per_pos_total{position="i"}` counts drafts whose token i was accepted.
"""

from __future__ import annotations

import threading

from dflash_cli.decoding.result import GenerationResult

PREFIX = "vllm:"


class ServerMetrics:
    def __init__(self, model_name: str, block_size: int) -> None:
        self.model_name = model_name
        self.width = max(0, block_size - 1)  # draft tokens per draft
        self._lock = threading.Lock()
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.success: dict[str, int] = {}  # finished_reason -> requests
        self.errors = 0
        self.rejected = 0  # 503: the queue was full
        self.drafts = 0
        self.draft_tokens = 0
        self.accepted_tokens = 0
        self.accepted_per_pos = [0] * self.width
        self.batch_stats = None  # decoding/batching.py's BatchStats when requests are batched

    def record(self, result: GenerationResult, finish_reason: str) -> None:
        with self._lock:
            self.prompt_tokens += result.prompt_tokens
            self.generation_tokens += result.new_tokens
            self.success[finish_reason] = self.success.get(finish_reason, 0) + 1
            if result.mode == "plain":
                return
            for length in result.accept_lengths:
                accepted = min(length - 1, self.width)  # the last committed token is the target's own
                self.drafts += 1
                self.draft_tokens += self.width
                self.accepted_tokens += accepted
                for i in range(accepted):
                    self.accepted_per_pos[i] += 1

    def count_finished(self, finish_reason: str) -> None:
        """A request that ended before it generated anything (cancelled while waiting)."""
        with self._lock:
            self.success[finish_reason] = self.success.get(finish_reason, 0) + 1

    def count_error(self) -> None:
        with self._lock:
            self.errors += 1

    def count_rejected(self) -> None:
        with self._lock:
            self.rejected += 1

    def render(self, running: int, waiting: int) -> str:
        label = f'model_name="{_escape(self.model_name)}"'
        lines: list[str] = []

        def metric(name: str, kind: str, help_: str, samples: list[tuple[str, float]]) -> None:
            full = PREFIX + name + ("_total" if kind == "counter" else "")
            lines.append(f"# HELP {full} {help_}")
            lines.append(f"# TYPE {full} {kind}")
            for extra, value in samples:
                labels = label + (f",{extra}" if extra else "")
                lines.append(f"{full}{{{labels}}} {float(value)}")

        with self._lock:
            metric("num_requests_running", "gauge", "Requests being decoded.", [("", running)])
            metric("num_requests_waiting", "gauge", "Requests waiting in the queue.", [("", waiting)])
            metric("prompt_tokens", "counter", "Prompt tokens processed.", [("", self.prompt_tokens)])
            metric("generation_tokens", "counter", "Tokens generated.", [("", self.generation_tokens)])
            reasons = sorted(set(self.success) | {"stop", "length"})
            metric(
                "request_success",
                "counter",
                "Requests finished, by finish reason.",
                [(f'finished_reason="{r}"', self.success.get(r, 0)) for r in reasons],
            )
            metric("spec_decode_num_drafts", "counter", "Verify steps (drafts checked).", [("", self.drafts)])
            metric("spec_decode_num_draft_tokens", "counter", "Draft tokens proposed.", [("", self.draft_tokens)])
            metric(
                "spec_decode_num_accepted_tokens",
                "counter",
                "Draft tokens accepted by the target.",
                [("", self.accepted_tokens)],
            )
            metric(
                "spec_decode_num_accepted_tokens_per_pos",
                "counter",
                "Drafts whose token at this position was accepted.",
                [(f'position="{i}"', n) for i, n in enumerate(self.accepted_per_pos)],
            )
            if self.batch_stats is not None:
                lines += _batch_lines(self.batch_stats, label)
            lines.append("# HELP dflash:request_errors_total Requests that failed during generation.")
            lines.append("# TYPE dflash:request_errors_total counter")
            lines.append(f"dflash:request_errors_total{{{label}}} {float(self.errors)}")
            lines.append("# HELP dflash:requests_rejected_total Requests answered 503 because the queue was full.")
            lines.append("# TYPE dflash:requests_rejected_total counter")
            lines.append(f"dflash:requests_rejected_total{{{label}}} {float(self.rejected)}")
        return "\n".join(lines) + "\n"


def _batch_lines(stats, label: str) -> list[str]:
    """Batched model calls and the sequences they carried, per graph: their ratio is the mean batch size."""
    lines = []
    for name, help_, values in (
        ("batch_calls", "Batched model calls.", stats.calls),
        ("batch_sequences", "Sequences carried by batched model calls.", stats.sequences),
    ):
        lines += [f"# HELP dflash:{name}_total {help_}", f"# TYPE dflash:{name}_total counter"]
        lines += [f'dflash:{name}_total{{{label},graph="{g}"}} {float(v)}' for g, v in sorted(values.items())]
    lines += ["# HELP dflash:batch_size_max Most sequences one call has carried.", "# TYPE dflash:batch_size_max gauge"]
    lines.append(f"dflash:batch_size_max{{{label}}} {float(stats.largest)}")
    return lines


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
