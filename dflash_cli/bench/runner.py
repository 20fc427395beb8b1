"""Run plain decoding and the speculative modes (decoding/modes.py) on the same prompts, interleaved
sample by sample.

Every mode runs back-to-back on the same prompt ids, so machine noise (thermal state, other
processes) hits them alike; the mode order is reversed on odd samples so no mode always runs
first (plain first on even samples, DFlash before plain on odd ones). Each finished turn is
appended to the results log before the next starts, so `--resume` never repeats or loses one.

At temperature 0 every speculative mode must reproduce plain greedy decoding token for token;
mismatches are recorded and returned (see bench.gates.check_lossless), not raised mid-run, so the whole
dataset is measured and written before the bench fails.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from dflash_cli.bench.conversation import History, encode_turn, reply_text
from dflash_cli.bench.datasets import Sample
from dflash_cli.bench.results_log import ResultsLog, TurnKey, result_from_dict
from dflash_cli.decoding.modes import MODES, canonical
from dflash_cli.decoding.result import GenerationResult
from dflash_cli.errors import DFlashError

DEFAULT_MODES = ("plain", "dflash", "lookup")
BASELINE_MODE = "plain"


@dataclass(frozen=True)
class BenchSettings:
    """What the user chose; together with the engine's facts these make results comparable."""

    dataset: str  # the --dataset spec (built-in name or path)
    max_new_tokens: int = 256
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0
    repeat: int = 1  # each turn's modes run this many times (interleaved), each a separate record
    warmup: int = 0  # samples run first in every mode and discarded (caches, thread pools); the CLI's default is 1
    step_time_repeats: int = 20  # engine.step_times() repeats for the speedup decomposition; 0 skips it
    # Plain (the baseline) on its own target session with its best thread setting (spinning on), where
    # the engine can open one (Engine.open_plain_session): speedups are against the best plain decoding.
    plain_best: bool = True

    def comparable(self) -> dict[str, Any]:
        """Settings stored in the results-log header: a resumed run must match them all."""
        d = asdict(self)
        for detail in ("step_time_repeats", "warmup"):  # measurement details, not part of what samples produced
            d.pop(detail)
        return d


@dataclass(frozen=True)
class Mismatch:
    """Where a speculative mode first left plain greedy decoding."""

    sample_id: str
    turn: int
    mode: str
    position: int  # index into the generated tokens
    expected: int | None  # plain's token there (None: plain had stopped)
    got: int | None  # the mode's token there (None: the mode had stopped)


@dataclass
class TurnRecord:
    sample_id: str
    turn: int
    results: dict[str, GenerationResult]  # mode -> result, same prompt ids
    resumed: bool = False  # read back from the results log instead of generated in this run
    rep: int = 0  # which repetition (--repeat) of this turn

    def to_log(self) -> dict[str, Any]:
        return {
            "sample_id": self.sample_id,
            "turn": self.turn,
            "rep": self.rep,
            "results": {mode: r.to_dict() for mode, r in self.results.items()},
        }


@dataclass(frozen=True)
class BenchProgress:
    """One finished turn, for a live display."""

    done: int  # turns finished, resumed ones included
    total: int
    sample_id: str
    turn: int
    resumed: bool
    tau: float | None  # running DFlash mean acceptance length, None before any DFlash step


@dataclass
class BenchResult:
    settings: dict[str, Any]  # the results-log header: BenchSettings.comparable() + engine facts
    engine_info: dict[str, Any]  # provider, weight bytes, block size, recipe, artifact keys
    modes: tuple[str, ...]
    sample_ids: list[str]
    records: list[TurnRecord]  # in dataset order
    mismatches: list[Mismatch] = field(default_factory=list)
    lossless_checked: bool = False
    step_times: dict[str, Any] | None = None  # engine.step_times(): t1, t_verify, t_draft, t_verify_curve (median s)

    def results_for(self, mode: str) -> list[GenerationResult]:
        return [r.results[mode] for r in self.records if mode in r.results]

    @property
    def block_size(self) -> int:
        return int(self.engine_info["block_size"])


def run_bench(
    engine: Any,
    samples: Sequence[Sample],
    settings: BenchSettings,
    *,
    modes: Sequence[str] = DEFAULT_MODES,
    results_log: ResultsLog | None = None,
    on_progress: Callable[[BenchProgress], None] | None = None,
) -> BenchResult:
    """Generate every turn of every sample in each mode; persist and return the paired results.

    `engine` follows dflash_cli.decoding.engine.Engine (encode_prompt, decode, generate,
    step_times and its descriptive attributes). `results_log` is started (resumed or
    overwritten) and closed here. Lossless mismatches are returned in `BenchResult.mismatches`;
    call bench.gates.check_lossless to turn them into a LosslessError.
    """
    modes = _validate_modes(modes)
    engine_info = describe_engine(engine)
    if settings.plain_best and BASELINE_MODE in modes and hasattr(engine, "open_plain_session"):
        engine_info["plain_session"] = engine.open_plain_session()
    header = {**settings.comparable(), "modes": list(modes), **_comparable_engine_facts(engine_info)}
    finished: dict[TurnKey, dict[str, Any]] = {}
    history_mode = BASELINE_MODE if BASELINE_MODE in modes else modes[0]
    total = sum(len(s.turns) for s in samples) * settings.repeat
    records: list[TurnRecord] = []
    tau_sum = tau_steps = 0
    try:
        if results_log is not None:
            finished = results_log.start(header)
        for sample in samples[: settings.warmup]:  # run and discarded: first calls pay for allocation
            prompt_ids, images = _encode(engine, [], sample, 0)
            for mode in modes:
                _generate(engine, prompt_ids, mode, settings, sample.id, 0, images, sample.constraint)
        for index, sample in enumerate(samples):
            history: History = []
            for turn, user in enumerate(sample.turns):
                prompt_ids: list[int] | None = None
                images = None
                for rep in range(settings.repeat):
                    # Alternate the order per sample and repetition: each mode runs first as often as last.
                    order = tuple(modes) if (index + rep) % 2 == 0 else tuple(reversed(modes))
                    logged = finished.get((sample.id, turn, rep))
                    if logged is not None:  # the header check guarantees it holds the same modes
                        record = TurnRecord(sample.id, turn, _results_from_log(logged), resumed=True, rep=rep)
                    else:
                        if prompt_ids is None:
                            prompt_ids, images = _encode(engine, history, sample, turn)
                        results = {
                            m: _generate(engine, prompt_ids, m, settings, sample.id, turn, images, sample.constraint)
                            for m in order
                        }
                        record = TurnRecord(sample.id, turn, {m: results[m] for m in modes}, rep=rep)
                        if results_log is not None:
                            results_log.append(record.to_log())
                    records.append(record)
                    if "dflash" in record.results:
                        tau_sum += sum(record.results["dflash"].accept_lengths)
                        tau_steps += len(record.results["dflash"].accept_lengths)
                    if rep == 0 and turn + 1 < len(sample.turns):
                        # Every mode answers the next turn after the same history: the baseline's reply.
                        history.append((user, reply_text(engine, record.results[history_mode].tokens)))
                    if on_progress is not None:
                        on_progress(
                            BenchProgress(
                                done=len(records),
                                total=total,
                                sample_id=sample.id,
                                turn=turn,
                                resumed=record.resumed,
                                tau=tau_sum / tau_steps if tau_steps else None,
                            )
                        )
    finally:
        if results_log is not None:
            results_log.close()

    check = settings.temperature == 0 and BASELINE_MODE in modes and len(modes) > 1
    result = BenchResult(
        settings=header,
        engine_info=engine_info,
        modes=modes,
        sample_ids=[s.id for s in samples],
        records=records,
        mismatches=[m for r in records for m in find_mismatches(r)] if check else [],
        lossless_checked=check,
    )
    if settings.step_time_repeats > 0 and "dflash" in modes:
        result.step_times = dict(engine.step_times(repeats=settings.step_time_repeats))
    return result


def find_mismatches(record: TurnRecord) -> list[Mismatch]:
    """Each speculative mode's first divergence from the plain tokens of the same turn."""
    expected = record.results[BASELINE_MODE].tokens
    found = []
    for mode, result in record.results.items():
        if mode == BASELINE_MODE:
            continue
        position = first_difference(expected, result.tokens)
        if position is not None:
            found.append(
                Mismatch(
                    sample_id=record.sample_id,
                    turn=record.turn,
                    mode=mode,
                    position=position,
                    expected=expected[position] if position < len(expected) else None,
                    got=result.tokens[position] if position < len(result.tokens) else None,
                )
            )
    return found


def first_difference(a: Sequence[int], b: Sequence[int]) -> int | None:
    """First index where the sequences differ (a length difference counts), None when equal."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def describe_engine(engine: Any) -> dict[str, Any]:
    """The engine facts a report needs, read once (see the Engine contract)."""
    return {
        "recipe": engine.recipe_name,
        "block_size": int(engine.block_size),
        "artifact_keys": dict(engine.artifact_keys),
        "provider": engine.provider,
        "weight_bytes": dict(engine.weight_bytes),
        "target_macs_per_row": _target_macs(engine),
        "ctx_len": int(engine.ctx_len),
        "compile": dict(getattr(engine, "compile_facts", None) or {}),
        "run": _output_settings(engine),
    }


def _target_macs(engine: Any) -> int | None:
    """Multiply-adds per token in the target's weight products (an ONNX Runtime build's graph), else None."""
    compile_dir = getattr(engine, "compile_dir", None)
    graph = compile_dir / "target.onnx" if compile_dir is not None else None
    if graph is None or not graph.is_file():
        return None
    from dflash_cli.ortcompile.checks import projection_macs

    return projection_macs(graph) or None


def _output_settings(engine: Any) -> dict[str, Any]:
    """The recipe's `run.*` settings that change what a prompt produces (not its length or sampling)."""
    run = getattr(getattr(engine, "recipe", None), "run", None)
    if run is None:
        return {}
    out = {"chat_template": run.chat_template, "enable_thinking": run.enable_thinking, "stop": list(run.stop)}
    penalty = getattr(run, "repetition_penalty", 1.0)  # a run section without the field: off
    return out | ({"repetition_penalty": penalty} if penalty != 1.0 else {})


def _comparable_engine_facts(info: dict[str, Any]) -> dict[str, Any]:
    # Provider and weight sizes follow from the artifacts; recipe, block size and keys pin them.
    facts = {"recipe": info["recipe"], "block_size": info["block_size"], "artifact_keys": info["artifact_keys"]}
    if info.get("run"):  # a resumed run must not mix answers made with another template or stop list
        facts["run"] = info["run"]
    return facts


def _validate_modes(modes: Sequence[str]) -> tuple[str, ...]:
    modes = tuple(canonical(m) for m in modes)  # an old name ("pld") runs, and is logged, as its mode
    unknown = [m for m in modes if m not in MODES]
    if not modes or unknown or len(set(modes)) != len(modes):
        raise DFlashError(
            f"invalid modes {','.join(modes) or '(none)'}",
            hint=f"choose distinct modes among {','.join(MODES)} (plain is the baseline for speedups)",
        )
    return modes


def _results_from_log(record: dict[str, Any]) -> dict[str, GenerationResult]:
    return {mode: result_from_dict(data) for mode, data in record["results"].items()}


def _generation_seed(seed: int, sample_id: str, turn: int) -> int:
    # Per-turn seed from the sample's identity, so a resumed or subset run samples the same way.
    return (seed * 1_000_003 + zlib.crc32(f"{sample_id}\0{turn}".encode())) % 2**31


def _encode(engine: Any, history: History, sample: Sample, turn: int):
    """(prompt ids, image inputs or None) of a sample's turn; a row with images is one turn, images first."""
    if sample.images:
        try:
            return engine.encode_with_images(sample.turns[0], list(sample.images))
        except DFlashError as exc:
            raise type(exc)(f"sample {sample.id!r}: {exc.message}", exc.hint) from exc
    return encode_turn(engine, history, sample.turns[turn]), None


def _generate(
    engine: Any,
    prompt_ids: list[int],
    mode: str,
    settings: BenchSettings,
    sample_id: str,
    turn: int,
    images: Any = None,
    constraint: Any = None,
) -> GenerationResult:
    extra = {"images": images} if images is not None else {}  # engines without images take none
    if constraint is not None:
        extra["constraint"] = constraint
    penalty = _output_settings(engine).get("repetition_penalty")
    if penalty is not None:  # the recipe's, as `dflash run` applies it
        extra["repetition_penalty"] = penalty
    try:
        return engine.generate(
            prompt_ids,
            mode=mode,
            max_new_tokens=settings.max_new_tokens,
            temperature=settings.temperature,
            top_k=settings.top_k,
            top_p=settings.top_p,
            seed=_generation_seed(settings.seed, sample_id, turn),
            **extra,
        )
    except DFlashError as exc:
        # Name the prompt: a dataset can hold one bad (e.g. over-long) prompt among hundreds.
        raise type(exc)(f"sample {sample_id!r} turn {turn} ({mode}): {exc.message}", exc.hint) from exc
