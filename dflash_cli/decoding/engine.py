"""The built pair, ready to generate: tokenizer, target and draft sessions, and the decoding loops.

`Engine.load` opens the artifacts of an already-built recipe; `build_engine` builds what is
missing first. Both the CLI (`dflash run`, `dflash bench`) and other programs use this API.
"""

from __future__ import annotations

import copy
import json
import threading
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

from dflash_cli.decoding.constraint import Constraint, ConstraintSpec, compile_constraint, llguidance_tokenizer
from dflash_cli.decoding.learnt import Learnt
from dflash_cli.decoding.logprobs import MAX_TOP
from dflash_cli.decoding.loops import LoopConfig, generate_plain, generate_speculative
from dflash_cli.decoding.make_proposer import make_proposer
from dflash_cli.decoding.modes import MODES, canonical
from dflash_cli.decoding.penalty import RepetitionPenalty
from dflash_cli.decoding.result import GenerationResult
from dflash_cli.decoding.sampling import SamplingConfig
from dflash_cli.decoding.sessions import open_session as _open  # tests open sessions through `_open`
from dflash_cli.decoding.sessions import weight_bytes
from dflash_cli.decoding.settings import DecodeSettings
from dflash_cli.decoding.target_calls import TimedSession
from dflash_cli.decoding.tokenizer import load_tokenizer
from dflash_cli.errors import GenerationError
from dflash_cli.families import family_named
from dflash_cli.vision.feeds import ImagePrompt


@dataclass(frozen=True)
class Artifacts:
    inject: Path
    export: Path
    compile: Path
    keys: dict[str, str]


class Engine:
    def __init__(self, recipe: Any, artifacts: Artifacts) -> None:
        self.recipe = recipe  # for reporting; decoding and serving read `settings`
        self.recipe_name = recipe.name
        self.settings = DecodeSettings.from_recipe(recipe)
        self.artifact_keys = dict(artifacts.keys)
        self.compile_dir = artifacts.compile
        self.export_dir = artifacts.export
        facts = artifacts.compile / "compile.json"
        self.compile_facts: dict = json.loads(facts.read_text()) if facts.is_file() else {}
        info = json.loads((artifacts.export / "export.json").read_text())
        pair = json.loads((artifacts.inject / "pair.json").read_text())
        self.block_size: int = info["block_size"]
        self.ctx_len: int = info["ctx_len"]
        self.prefill_len: int = info["prefill_seq_len"]
        self.emits_logits: bool = info.get("logits", False)
        self.mask_token_id: int = pair["mask_token_id"]
        self.vocab_size: int = pair["vocab_size"]
        self.hidden_size: int = pair["hidden_size"]
        self.eos_token_ids: list[int] = list(pair.get("eos_token_ids") or [])
        self.tokenizer = load_tokenizer(artifacts.inject / "target")
        if self.tokenizer.eos_token_id is not None and self.tokenizer.eos_token_id not in self.eos_token_ids:
            self.eos_token_ids.append(self.tokenizer.eos_token_id)
        self._lltokenizer, self._lltokenizer_lock = None, threading.Lock()  # the grammars' view, built when needed
        backend = self.settings.backend
        self._tables = None
        o = self.settings.ort
        if backend == "ort" and o.thread_pool == "shared":
            from dflash_cli.host.ort_threads import use_shared_thread_pool

            use_shared_thread_pool(o.intra_op_threads)  # before any session of this engine opens
        if backend == "ort":
            from dflash_cli.backends.ort_shared import SharedTables

            self._tables = SharedTables()  # the embedding both graphs read: one memory map for both sessions
        # Sessions of this build: (backend, graph=..., spinning=...) -> a session (decoding/sessions.py)
        self._open_session = partial(_open, compile_dir=artifacts.compile, recipe=recipe, tables=self._tables)
        self.target = self._open_session(backend, graph="target")
        self._draft = None  # opened on first use: plain decoding never loads the draft
        self._plain_target = None  # see open_plain_session
        self.learnt = Learnt()  # what the proposers learn across this engine's requests (decoding/learnt.py)
        self.provider = getattr(self.target, "provider", backend)
        self.weight_bytes = {
            g: weight_bytes(artifacts.compile, info["graphs"][g]["onnx"], backend) for g in ("target", "draft")
        }
        self.images = None  # a vision-language target's (decoding/images.py)
        if "vision" in info["graphs"]:
            from dflash_cli.decoding.images import ImageReader

            tower = artifacts.compile / info["graphs"]["vision"]["onnx"]
            if not tower.is_file():  # QAIC: the runtime does not load the vision program; the host runs the tower
                tower = artifacts.export / info["graphs"]["vision"]["onnx"]
            self.images = ImageReader(artifacts.inject / "target", tower)

    @property
    def draft(self):
        if self._draft is None:
            self._draft = self._open_session(self.settings.backend, graph="draft")
        return self._draft

    @draft.setter
    def draft(self, session) -> None:  # the fp16 readiness check swaps sessions in and out
        self._draft = session

    def open_plain_session(self) -> str:
        """Give plain decoding a target session of its own with spinning intra-op threads (bench's baseline).

        Spinning is off for the speculative modes (target and draft take turns on the same cores and a
        spinning pool steals them: DFlash measured 0.80x with it on) but makes plain decoding faster
        (1.05x fp32 and int4 on the 0.6B shape), so a speedup against plain-with-the-same-setting would
        flatter DFlash. Costs a second copy of the target's weights: skipped when they are large, and
        with the shared thread pool (compile.ort.thread_pool), where every session already spins on the
        same threads. Returns what plain runs on.
        """
        from dflash_cli.host.ort_threads import shared_thread_pool
        from dflash_cli.readiness.memory import available_bytes

        o = self.settings.ort
        if self.settings.backend != "ort" or self.provider != "CPUExecutionProvider":
            return "the speculative target session (spinning applies to ONNX Runtime on CPU only)"
        if shared_thread_pool():
            return "the speculative target session (one spinning thread pool shared by every session)"
        if o.allow_spinning:
            return "the speculative target session (spinning already on)"
        need, free = self.weight_bytes["target"], available_bytes()
        if free is not None and need > free // 4:
            return f"the speculative target session (a second copy, {need / 2**30:.1f} GiB, does not fit)"
        if self._plain_target is None:
            self._plain_target = self._open_session("ort", graph="target", spinning=True)
        return "its own target session, spinning on"

    @classmethod
    def load(cls, recipe: Any, cache: Any) -> Engine:
        """Open a built recipe. The engine holds its artifacts (shared locks) for as long as it lives, so
        `dflash cache clean` leaves them alone; `release_artifacts()` lets go earlier."""
        from dflash_cli.cache.contents import ContentCheck
        from dflash_cli.stages.pipeline import artifact_paths, build_command

        holds: list = []
        try:
            paths = artifact_paths(recipe, cache, ("inject", "export", "compile"), holds=holds)
            keys = {s: p.name for s, p in paths.items()}
            # Hashed beside the session loads, which read the same bytes; nothing is generated before it passes.
            contents = ContentCheck(paths, build_command(recipe))
            engine = cls(recipe, Artifacts(paths["inject"], paths["export"], paths["compile"], keys))
            contents.wait()
        except BaseException:
            for held in holds:
                held.release()
            raise
        engine._artifact_holds = holds
        return engine

    def release_artifacts(self) -> None:
        """Let `dflash cache clean` remove this engine's artifacts (sessions opened later may then fail)."""
        for held in getattr(self, "_artifact_holds", ()):
            held.release()
        self._artifact_holds = []

    # --- text ---------------------------------------------------------------------------------
    def encode_prompt(self, prompt: str | list[dict]) -> list[int]:
        settings = self.settings
        if isinstance(prompt, str) and not prompt.strip():
            raise GenerationError("the prompt is empty", hint='pass some text: --prompt "def fibonacci(n):"')
        if settings.chat_template and getattr(self.tokenizer, "chat_template", None):
            messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
            return self._templated(messages, settings.enable_thinking)
        if not isinstance(prompt, str):
            prompt = "\n\n".join(m["content"] for m in prompt)
        return list(self.tokenizer(prompt)["input_ids"])

    def encode_chat(
        self, messages: list[dict], enable_thinking: bool | None = None, tools: list[dict] | None = None
    ) -> list[int]:
        """Chat messages through the tokenizer's chat template whatever `run.chat_template` says (a chat
        request is a chat); a tokenizer without a template gets the contents joined, as encode_prompt does.
        `tools` (OpenAI's function tools) are rendered by the template, which must take them."""
        template = getattr(self.tokenizer, "chat_template", None)
        if tools and (not isinstance(template, str) or "tools" not in template):
            raise GenerationError(
                "this model's chat template does not render tools", hint="send the request without 'tools'"
            )
        if not template:
            return list(self.tokenizer("\n\n".join(m["content"] for m in messages))["input_ids"])
        thinking = self.settings.enable_thinking if enable_thinking is None else enable_thinking
        return self._templated(messages, thinking, tools)

    def _templated(self, messages: list[dict], enable_thinking: bool, tools: list[dict] | None = None) -> list[int]:
        family = family_named(self.settings.family)
        kwargs = {"enable_thinking": enable_thinking} if family.thinking_switch else {}
        if tools:
            kwargs["tools"] = tools
        if family.reasoning_effort and self.settings.reasoning_effort:  # harmony's system line
            kwargs["reasoning_effort"] = self.settings.reasoning_effort
        text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kwargs)
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def encode_with_images(self, prompt: str | list[dict], images: list) -> tuple[list[int], ImagePrompt]:
        """A prompt with images (paths or PIL images) as token ids and the target's image inputs (images.py)."""
        from dflash_cli.decoding.images import encode_with_images

        return encode_with_images(self, prompt, images)

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def with_own_tokenizer(self) -> Engine:
        """This engine with a tokenizer of its own, for encoding on one thread while another decodes
        (a fast tokenizer refuses concurrent use: "Already borrowed"). Sessions are shared."""
        view = copy.copy(self)
        view.tokenizer = copy.deepcopy(self.tokenizer)
        view.learnt = self.learnt.copy()  # parts learnt so far shared, parts not yet made made apart
        return view

    def with_sessions(self, target, draft) -> Engine:
        """This engine decoding on other sessions (a batch slot's, decoding/batched_engine.py), with a tokenizer
        of its own and no plain-decoding session: plain runs on `target` too."""
        view = self.with_own_tokenizer()
        view.target, view._draft, view._plain_target = target, draft, None
        return view

    @property
    def shared_tables(self):
        """The memory-mapped tables this engine's ONNX Runtime sessions share (backends/ort_shared.py), or None."""
        return self._tables

    # --- generation ---------------------------------------------------------------------------
    @property
    def positions_for_generation(self) -> int:
        """Prompt + new tokens a request may use: one slot is the padding sink, and a verify block
        may run B-1 positions past the last token."""
        return self.ctx_len - 1 - self.block_size

    def check_request(
        self, prompt_ids: list[int], max_new_tokens: int, temperature: float, top_k: int = 0, top_p: float = 1.0
    ) -> None:
        bad = [
            f"{name} {value!r} ({rule})"
            for name, value, ok, rule in (
                ("max_new_tokens", max_new_tokens, max_new_tokens >= 1, "at least 1"),
                ("temperature", temperature, temperature >= 0, "0 = greedy, or positive"),
                ("top_k", top_k, top_k >= 0, "0 = off, or positive"),
                ("top_p", top_p, 0 < top_p <= 1, "in (0, 1]"),
            )
            if not ok
        ]
        if bad:
            raise GenerationError(f"invalid generation settings: {'; '.join(bad)}", hint="see `dflash run --help`")
        if not prompt_ids:
            raise GenerationError("the prompt is empty", hint='pass some text: --prompt "def fibonacci(n):"')
        room = self.positions_for_generation
        if len(prompt_ids) + max_new_tokens > room:
            raise GenerationError(
                f"prompt ({len(prompt_ids)} tokens) + max_new_tokens ({max_new_tokens}) exceeds the "
                f"{room} positions this build allows (ctx_len {self.ctx_len})",
                hint=f"shorten the prompt, lower --max-new-tokens, or rebuild with --set export.ctx_len="
                f"{_round_up(len(prompt_ids) + max_new_tokens + self.block_size + 1, 256)}",
            )
        if temperature > 0 and not self.emits_logits:
            raise GenerationError(
                "sampling (temperature > 0) needs logits, but this build emits token ids only",
                hint="rebuild with `--set export.logits=true`, or use --temperature 0",
            )

    def check_logprobs(self, logprobs: int | None, prompt_logprobs: bool = False) -> None:
        """Logprobs come from the logits rows, which a build exports only with export.logits."""
        if logprobs is None and not prompt_logprobs:
            return
        if logprobs is not None and not 0 <= logprobs <= MAX_TOP:
            raise GenerationError(f"logprobs {logprobs} is not in 0..{MAX_TOP}", hint="ask for at most 20 alternatives")
        if not self.emits_logits:
            raise GenerationError(
                "logprobs need logits, but this build emits token ids only",
                hint="rebuild with `--set export.logits=true`",
            )

    def compile_constraint(self, spec: ConstraintSpec) -> Constraint:
        """A fresh grammar state for one generation; refused where the build gives no logits to mask."""
        if not self.emits_logits:
            raise GenerationError(
                f"a {spec.kind} constraint masks the logits, but this build emits token ids only",
                hint="rebuild with `--set export.logits=true`",
            )
        with self._lltokenizer_lock:
            if self._lltokenizer is None:
                self._lltokenizer = llguidance_tokenizer(self.tokenizer, self.vocab_size, self.eos_token_ids)
        return compile_constraint(spec, self._lltokenizer)

    def repetition_penalty(self, penalty: float, prompt_ids: list[int], grammar: Constraint | None):
        """A fresh penalty state for one generation (decoding/penalty.py), picking under `grammar` where given."""
        if not penalty > 0:
            raise GenerationError(f"repetition_penalty {penalty!r} is not positive", hint="1 = off; 1.1-1.5 is usual")
        if not self.emits_logits:
            raise GenerationError(
                "a repetition penalty changes the logits, but this build emits token ids only",
                hint="rebuild with `--set export.logits=true`",
            )
        return RepetitionPenalty(penalty, prompt_ids, self.vocab_size, grammar)

    def generate(
        self,
        prompt_ids: list[int],
        *,
        mode: str = "dflash",
        max_new_tokens: int = 128,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        seed: int = 0,
        on_commit=None,
        images: ImagePrompt | None = None,
        ignore_eos: bool = False,  # only max_new_tokens (or on_commit) ends it: what load generators ask
        logprobs: int | None = None,
        prompt_logprobs: bool = False,
        constraint: ConstraintSpec | None = None,
        logprobs_out: list | None = None,
        repetition_penalty: float = 1.0,
    ) -> GenerationResult:
        """`images`: a vision-language prompt's image inputs (ImageReader.prompt / encode) for `prompt_ids`.
        `logprobs`: each new token's logprob and that many likeliest alternatives (None: none); `prompt_logprobs`:
        each prompt token's too (decoding/logprobs.py), appended to `logprobs_out` (where given) as tokens are
        committed, before `on_commit` sees them; `constraint`: a grammar the answer follows
        (decoding/constraint.py); `repetition_penalty`: above 1, tokens already seen are less likely
        (decoding/penalty.py; 1: off)."""
        mode = canonical(mode)  # an old name ("pld") runs its mode, reported by the mode's one name
        if mode not in MODES:
            raise GenerationError(f"unknown mode {mode!r}", hint=f"one of {', '.join(MODES)}")
        self.check_request(prompt_ids, max_new_tokens, temperature, top_k, top_p)
        self.check_logprobs(logprobs, prompt_logprobs)
        grammar = None if constraint is None else self.compile_constraint(constraint)
        if repetition_penalty != 1.0:
            grammar = self.repetition_penalty(repetition_penalty, prompt_ids, grammar)
        sessions = [s for s in (self.target, self._plain_target) if s is not None]
        if images is not None:
            if self.images is None or not all(getattr(s, "vision", None) for s in sessions):
                raise GenerationError(
                    "this target takes no images", hint="a vision-language build (Qwen3-VL, Gemma 4, Qwen3.5) does"
                )
            if images.length != len(prompt_ids):
                raise GenerationError("the image inputs were made for another prompt", hint="this is a dflash bug")
        feeders = [s.vision for s in sessions if getattr(s, "vision", None) is not None]
        for f in feeders:
            f.prompt = images  # the target's calls of this sequence take them (vision/feeds.py)
        try:
            stops = frozenset() if ignore_eos else frozenset(self.eos_token_ids)
            cfg = LoopConfig(
                max_new_tokens,
                stops,
                SamplingConfig(temperature, top_k, top_p, seed),
                logprobs=0 if prompt_logprobs and logprobs is None else logprobs,
                prompt_logprobs=prompt_logprobs,
                constraint=grammar,
                logprobs_out=logprobs_out,
            )
            return self._generate(prompt_ids, mode, cfg, on_commit)
        finally:
            for f in feeders:
                f.prompt = None

    def _generate(self, prompt_ids: list[int], mode: str, cfg: LoopConfig, on_commit) -> GenerationResult:
        if mode == "plain" and self._plain_target is not None:
            self._plain_target.reset()
            return generate_plain(TimedSession(self._plain_target), prompt_ids, self.prefill_len, cfg, on_commit)
        self.target.reset()
        target = TimedSession(self.target)
        if mode == "plain":
            return generate_plain(target, prompt_ids, self.prefill_len, cfg, on_commit)
        proposer = make_proposer(self, mode, self.learnt, self.settings.verify)
        return generate_speculative(target, proposer, prompt_ids, self.prefill_len, self.block_size, cfg, on_commit)

    def step_times(self, repeats: int = 20) -> dict[str, Any]:
        """Median seconds of each kind of call, warm (decoding/step_times.py)."""
        from dflash_cli.decoding.step_times import step_times

        return step_times(self.target, self.draft, self.block_size, self.hidden_size, repeats)

    def verify_cost_curve(self, sizes: tuple[int, ...] = (1, 2, 4, 8, 16), repeats: int = 20) -> dict[int, float]:
        from dflash_cli.decoding.step_times import verify_cost_curve

        return verify_cost_curve(self.target, sizes, repeats)


def _round_up(n: int, m: int) -> int:
    return (n + m - 1) // m * m


def build_engine(recipe: Any, cache: Any, progress=None) -> Engine:
    """Build every missing stage of `recipe`, then load the engine."""
    from dflash_cli.stages.pipeline import build

    # The build's holds last until the engine holds the artifacts itself: `clean` cannot slip in between.
    with build(recipe, cache, progress=progress, hold=True) if progress else build(recipe, cache, hold=True):
        return Engine.load(recipe, cache)
