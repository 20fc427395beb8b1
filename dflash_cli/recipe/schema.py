"""Recipe schema and loading: defaults < YAML < `--set a.b=c`, every problem reported at once.

A recipe names a target checkpoint, a DFlash draft and how to build and run the pair. Checkpoint
paths are only made absolute here; resolving a Hugging Face repo id from the local cache is the
convert stage's job.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, field_validator, model_validator

from dflash_cli.errors import RecipeError
from dflash_cli.families import FAMILIES, FAMILY_NAMES
from dflash_cli.recipe.files import DEFAULT_RECIPE, did_you_mean, find_recipe

MIN_BLOCK = 2  # one last-committed token plus at least one mask


class _Section(BaseModel):
    # Unknown keys are errors (a typo must not silently fall back to a default); recipes are immutable.
    model_config = ConfigDict(extra="forbid", frozen=True)


class CheckpointRef(_Section):
    path: str = Field(min_length=1)  # local directory, or a Hugging Face repo id (resolved offline later)


class DFlashConfig(_Section):
    # None means "take it from the draft checkpoint's config".
    block_size: int | None = Field(default=None, ge=MIN_BLOCK)
    target_layer_ids: list[int] | None = None
    mask_token_id: int | None = Field(default=None, ge=0)

    @field_validator("target_layer_ids")
    @classmethod
    def _layer_ids(cls, ids: list[int] | None) -> list[int] | None:
        if ids is None:
            return ids
        if not ids:
            raise ValueError("must list at least one layer (or be null to use the draft's config)")
        if any(i < 0 for i in ids):
            raise ValueError("layer ids must be >= 0")
        if len(set(ids)) != len(ids):
            raise ValueError("layer ids must be unique")
        return ids


class ExportConfig(_Section):
    ctx_len: int = Field(default=1024, gt=0)
    prefill_seq_len: int = Field(default=64, gt=0)
    opset: int = Field(default=18, ge=13)
    exporter: Literal["dynamo", "torchscript"] = "dynamo"
    # Weight and compute dtype of the graphs: fp16 halves the artifact for accelerators that run fp16.
    dtype: Literal["fp32", "fp16"] = "fp32"
    logits: bool = False
    validate_outputs: bool = Field(default=True, alias="validate")  # `validate` shadows a BaseModel method
    # auto: an int8/int4 ONNX Runtime build's export leaves out the checkpoint's weights (its compile reads them
    # from the checkpoint), so the cache holds no full-precision copy; all: write them (QAIC, fp16 emulation).
    weights: Literal["auto", "all"] = "auto"

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True, serialize_by_alias=True)


class OrtConfig(_Section):
    # int8 / int4: weight-only MatMulNBits (block-wise scales along K), so every position's output is
    # independent of the other tokens in the call and greedy speculative decoding stays lossless.
    # w8a8: int8 weights (a scale per column) times each activation row quantised on its own, summed as
    # integers (ortcompile/rows_product.py): exact at any call length, verify rows cost less.
    precision: Literal["fp32", "int8", "int4", "w8a8"] = "fp32"
    block_size: Literal[16, 32, 64, 128, 256] = 32  # quantisation block along K for int8 / int4 (w8a8: tables)
    # MatMulNBits' compute for int8 / int4: 4 = int8 dot products on activations quantised per row and block
    # (positions stay independent), 0 = fp32.
    accuracy_level: Literal[0, 4] = 4
    intra_op_threads: int = Field(default=0, ge=0)  # 0 = ONNX Runtime's default
    graph_optimization: Literal["disable", "basic", "extended", "all"] = "all"
    provider: Literal["auto", "cpu", "cuda"] = "auto"
    # Idle intra-op threads busy-wait by default; target and draft taking turns, one's spinning steals the other's CPU.
    allow_spinning: bool = False
    # `shared`: every session of a `dflash run` / `bench` / `serve` process uses one (spinning) intra-op
    # pool, so target and draft take turns on the same threads (backends/ort.py: plain 1.7-1.9x, DFlash
    # 1.2-1.4x faster on the demo pair); allow_spinning configures per-session pools only. `per_session`:
    # a pool per session, allow_spinning as set.
    thread_pool: Literal["shared", "per_session"] = "shared"
    # Rewrite the graphs for ONNX Runtime's fused kernels (dflash_cli.ortcompile.fuse): RMSNorm ->
    # SimplifiedLayerNormalization, the accelerator-only V guard dropped. Checked against the export.
    fuse: bool = True
    # With `fuse`: the prefix-cache target's attention -> ONNX Runtime's GroupQueryAttention (RoPE inside,
    # KV cache updated in place; ortcompile/gqa.py), checked against the export like the other rewrites.
    fuse_attention: bool = True
    # Run the prefix-cache graphs (CPU provider): the host keeps the KV cache and a call reads only the
    # filled slots, so its cost follows the tokens in the cache, not ctx_len. False: the static graphs.
    prefix_cache: bool = True


class QaicGraphConfig(_Section):
    """One program's placement; null = the section's `num_cores` (split between the programs that share a
    card) and `devices`."""

    num_cores: int | None = Field(default=None, gt=0)
    devices: list[int] | None = Field(default=None, min_length=1)


class QaicConfig(_Section):
    num_cores: int = Field(default=16, gt=0)  # the cores of one card the pair may use (8 + 8 when they share it)
    mxfp6_matmul: bool = False
    mxint8_kv_cache: bool = False
    mos: int | None = Field(default=None, gt=0)
    ols: int | None = Field(default=None, gt=0)
    aic_enable_depth_first: bool = False
    aic_hw_version: Literal["ai100", "ai200"] | None = None  # None = detect from qaic-util
    devices: list[int] = Field(default_factory=lambda: [0], min_length=1)
    target: QaicGraphConfig = QaicGraphConfig()
    draft: QaicGraphConfig = QaicGraphConfig()
    vision: QaicGraphConfig = QaicGraphConfig()  # a vision-language target's tower (Qwen3-VL)
    # Above 1: continuous batching, QEfficient's way: programs whose retained caches hold this many sequences,
    # each call naming its own with `batch_index` (modeling/slot_cache.py); `serve` batches up to this many.
    full_batch_size: int = Field(default=1, ge=1, le=64)

    @field_validator("devices")
    @classmethod
    def _devices(cls, devices: list[int]) -> list[int]:
        if any(d < 0 for d in devices):
            raise ValueError("device ids must be >= 0")
        if len(set(devices)) != len(devices):
            raise ValueError("device ids must be unique")
        return devices


class CompileConfig(_Section):
    backend: Literal["ort", "qaic"] = "ort"
    ort: OrtConfig = OrtConfig()
    qaic: QaicConfig = QaicConfig()


class RunConfig(_Section):
    max_new_tokens: int = Field(default=128, gt=0)
    temperature: float = Field(default=0.0, ge=0.0)
    top_k: int = Field(default=0, ge=0)  # 0 = no top-k filter
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    seed: int = Field(default=0, ge=0)
    # Above 1: a token already in the prompt or answer has its logit divided by this (Hugging Face's
    # repetition_penalty; decoding/penalty.py). Needs export.logits; speculation stays equal to plain under it.
    repetition_penalty: float = Field(default=1.0, gt=0.0)
    chat_template: bool = False
    enable_thinking: bool = False
    reasoning_effort: Literal["low", "medium", "high"] | None = None  # gpt-oss's chat template; None: its default
    stop: list[str] = Field(default_factory=list)
    # Who proposes: the DFlash draft, suffix lookup (no model), or per step whichever the evidence favours.
    drafter: Literal["dflash", "lookup", "hybrid"] = "dflash"
    # DFlash steps on a target that takes calls of any length (ONNX Runtime's prefix-cache graphs). auto: verify
    # only as far as the draft's confidence makes worth the call (decoding/verify_length.py); block: the whole
    # block every step. Static graphs (QAIC) always verify the block.
    verify: Literal["auto", "block"] = "auto"

    @field_validator("stop")
    @classmethod
    def _stop(cls, stop: list[str]) -> list[str]:
        if any(s == "" for s in stop):
            raise ValueError("stop strings must not be empty")
        return stop


class ServeConfig(_Section):
    host: str = "127.0.0.1"  # loopback by default: exposing a server is an explicit choice
    port: int = Field(default=8000, ge=0, le=65535)  # 0 = any free port (printed at start)
    queue_size: int = Field(default=8, ge=0)  # requests that may wait while the batch is full; more get 503
    # Requests decoded together (continuous batching, decoding/batching.py); 1 = one after another
    max_batch: int = Field(default=4, ge=1, le=64)
    max_request_bytes: int | None = Field(default=None, ge=1024)  # bigger bodies get 413; None: from ctx_len
    # A directory whose image files chat requests may name (file:// or a path); None: inline images only
    allowed_local_media_path: str | None = None


def export_shape_problems(block: int | None, prefill: int, ctx_len: int) -> list[str]:
    """The graphs' shape rule: a prefill chunk is whole blocks, and the cache holds a prefill chunk plus
    two blocks (a verify and the draft's block after it). `block` None: the smallest block there is."""
    problems = []
    if block is not None and prefill % block:
        problems.append(
            f"export.prefill_seq_len ({prefill}) must be a multiple of the block size ({block}): "
            f"e.g. --set export.prefill_seq_len={max(block, prefill // block * block)}"
        )
    room = prefill + 2 * (block or MIN_BLOCK)
    if ctx_len < room:
        problems.append(
            f"export.ctx_len ({ctx_len}) is too small for prefill {prefill} and block {block or MIN_BLOCK}: "
            f"at least {room}, e.g. --set export.ctx_len={room + 64}"
        )
    return problems


class Recipe(_Section):
    name: str = Field(min_length=1)
    family: Literal[FAMILY_NAMES]  # the registry's names (dflash_cli/families/), listed by the error if not one
    target: CheckpointRef
    draft: CheckpointRef
    dflash: DFlashConfig = DFlashConfig()
    export: ExportConfig = ExportConfig()
    compile: CompileConfig = CompileConfig()
    run: RunConfig = RunConfig()
    serve: ServeConfig = ServeConfig()

    _source: Path | None = PrivateAttr(default=None)
    _overrides: tuple[str, ...] = PrivateAttr(default=())

    @model_validator(mode="after")
    def _cross_field(self) -> Recipe:
        # Runs only once every section is valid. The draft's block size, when the recipe leaves it to
        # the checkpoint, is checked against the same rule by the export stage.
        problems = export_shape_problems(self.dflash.block_size, self.export.prefill_seq_len, self.export.ctx_len)
        if problems:
            raise ValueError("; ".join(problems))
        if self.compile.qaic.full_batch_size > 1 and not FAMILIES[self.family].qaic_slot_cache:
            slot_cache = ", ".join(name for name, fam in FAMILIES.items() if fam.qaic_slot_cache)
            raise ValueError(
                f"compile.qaic.full_batch_size needs a target whose layers all keep a K/V cache "
                f"({slot_cache}), not {self.family}; leave it at 1"
            )
        ort = self.compile.ort
        if ort.precision == "w8a8" and self.export.dtype != "fp32":
            raise ValueError("compile.ort.precision w8a8 computes on fp32 activations; set export.dtype fp32")
        return self

    @property
    def overrides(self) -> tuple[str, ...]:
        """The `--set KEY=VALUE` items applied on load (so hints can repeat them)."""
        return self._overrides

    @property
    def source(self) -> Path | None:
        """The YAML file this recipe was loaded from (None when built in code)."""
        return self._source

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump(mode="json", by_alias=True)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)


# ---------------------------------------------------------------------------------------------
# Loading


def load_recipe(name_or_path: str = DEFAULT_RECIPE, overrides: Sequence[str] = ()) -> Recipe:
    """Load a recipe by name or path, apply `--set KEY=VALUE` overrides, validate everything at once."""
    path = find_recipe(name_or_path)
    data = _read_yaml(path)
    data.setdefault("name", path.stem)
    _resolve_paths(data, base=path.parent)

    problems = []
    touched_paths = False
    for item in overrides:
        try:
            key, value = parse_override(item)
            _set_dotted(data, key, value)
        except ValueError as exc:
            problems.append(f"--set {item}: {exc}")
            continue
        touched_paths |= key.split(".")[0] in ("target", "draft")
    if touched_paths:
        # A path given on the command line is relative to where the command runs.
        _resolve_paths(data, base=Path.cwd())

    recipe: Recipe | None = None
    try:
        recipe = Recipe.model_validate(data)
    except ValidationError as exc:
        problems.extend(format_validation_errors(exc))
    if problems or recipe is None:
        raise RecipeError(
            f"recipe {name_or_path!r} is invalid: " + "; ".join(problems),
            hint="fix the recipe file or the --set value (`dflash recipes show NAME` prints the effective recipe)",
        )
    recipe._source = path.resolve()
    recipe._overrides = tuple(overrides)
    return recipe


def parse_override(item: str) -> tuple[str, Any]:
    """`a.b=c` -> ("a.b", c) with c parsed as a YAML scalar or list (`[1,3]`, `true`, `null`)."""
    key, sep, raw = item.partition("=")
    key = key.strip()
    if not sep or not key:
        raise ValueError("expected KEY=VALUE, e.g. --set export.ctx_len=2048")
    if any(not part for part in key.split(".")):
        raise ValueError(f"malformed key {key!r}")
    try:
        value = yaml.safe_load(raw) if raw.strip() else None
    except yaml.YAMLError as exc:
        raise ValueError(f"value is not valid YAML ({_yaml_problem(exc)})") from None
    return key, value


def format_validation_errors(exc: ValidationError) -> list[str]:
    """Pydantic errors as `dotted.path: message`, unknown keys as `path: unknown field`."""
    out = []
    for err in exc.errors():
        loc = ".".join(str(part) for part in err["loc"])
        if err["type"] == "extra_forbidden":
            msg = "unknown field" + _field_guess(err["loc"])
        else:
            msg = err["msg"].removeprefix("Value error, ")
        out.append(f"{loc}: {msg}" if loc else msg)
    return out


def _field_guess(loc: tuple) -> str:
    """Suggest the known field closest to an unknown one, from the schema of its section."""
    model: Any = Recipe
    for part in loc[:-1]:
        field = model.model_fields.get(str(part))
        model = getattr(field, "annotation", None) if field else None
        if not (isinstance(model, type) and issubclass(model, BaseModel)):
            return ""
    names = [f.alias or n for n, f in model.model_fields.items()]
    return did_you_mean(str(loc[-1]), names)


def _read_yaml(path: Path) -> dict[str, Any]:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise RecipeError(f"cannot read recipe {path}: {exc.strerror}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        raise RecipeError(
            f"recipe {path}: YAML syntax error{where}: {_yaml_problem(exc)}",
            hint="fix the YAML syntax (indentation, colons, quotes)",
        ) from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise RecipeError(f"recipe {path}: expected a mapping at the top level, got {type(data).__name__}")
    return data


def _yaml_problem(exc: yaml.YAMLError) -> str:
    return str(getattr(exc, "problem", None) or exc).strip()


def _set_dotted(data: dict[str, Any], key: str, value: Any) -> None:
    parts = key.split(".")
    node = data
    for i, part in enumerate(parts[:-1]):
        child = node.setdefault(part, {})
        if child is None:
            child = node[part] = {}
        if not isinstance(child, dict):
            raise ValueError(f"{'.'.join(parts[: i + 1])} is a value, not a section")
        node = child
    node[parts[-1]] = value


def _resolve_paths(data: dict[str, Any], base: Path) -> None:
    """Make target/draft paths absolute when they name a local path relative to `base`.

    A value that exists relative to `base`, or is written as a path (`./x`, `../x`, `~/x`, `/x`),
    is a local directory; anything else stays as given (e.g. a repo id like `Qwen/Qwen3-8B`).
    """
    for section in ("target", "draft"):
        ref = data.get(section)
        if not isinstance(ref, dict) or not isinstance(ref.get("path"), str) or not ref["path"]:
            continue
        raw = ref["path"]
        looks_local = raw.startswith(("./", "../", "~", "/")) or raw in (".", "..")
        candidate = base / Path(raw).expanduser()
        if looks_local or candidate.exists():
            ref["path"] = str(candidate.resolve())
