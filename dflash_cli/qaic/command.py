"""The compile options (the recipe's `compile.qaic` section) and the exact compiler command.

The command is built as a pure function of its inputs so that it can be pinned by golden
tests, run by `compile`, and written into a bundle's compile.sh with relative paths.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields, replace
from pathlib import PurePath
from typing import Any, get_args

from dflash_cli.errors import BackendError, RecipeError
from dflash_cli.qaic.sdk import HwVersion, QaicSdk
from dflash_cli.qaic.specs import (
    CUSTOM_IO_FILE,
    PARTITION_FILE,
    QPC_DIR,
    SPECIALIZATIONS_FILE,
    KvPrecision,
    SpecFormat,
)

HW_VERSIONS: tuple[str, ...] = get_args(HwVersion)
PROGRAMS = ("target", "draft", "vision")  # the vision program: a vision-language target's tower
SPEC_FORMATS: tuple[str, ...] = get_args(SpecFormat)


@dataclass(frozen=True)
class QaicCompileOptions:
    """Mirror of the recipe's `compile.qaic` section; every field changes the compiled program."""

    num_cores: int = 16  # NSP cores per device (-aic-num-cores)
    mxfp6_matmul: bool = False  # MatMul weights as MXFP6, compute fp16
    mxint8_kv_cache: bool = False  # KV cache precision mxint8 (custom IO), else float16
    mos: int | None = None  # -mos (max output splits); None = compiler default
    ols: int | None = None  # -ols (overlap splits); None = compiler default
    aic_enable_depth_first: bool = False
    aic_hw_version: HwVersion | None = None  # None: detect with qaic-util, ai100 if no card
    devices: tuple[int, ...] = (0,)  # QIDs to run on; >1 compiles a multi-device partition
    specialization_format: SpecFormat = "named"  # "legacy" for SDKs that want a flat list
    # Per-program placement (recipe compile.qaic.target / .draft / .vision); None = from num_cores / devices.
    target_num_cores: int | None = None
    draft_num_cores: int | None = None
    target_devices: tuple[int, ...] | None = None
    draft_devices: tuple[int, ...] | None = None
    # A vision-language target's tower, a third program (vision.onnx); placed only where the export has one.
    vision_num_cores: int | None = None
    vision_devices: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        # Accept a list from YAML but keep the object hashable and frozen.
        for name in ("devices", *(f"{g}_devices" for g in PROGRAMS)):
            if isinstance(getattr(self, name), list):
                object.__setattr__(self, name, tuple(getattr(self, name)))
        problems = self.problems()
        if problems:
            raise RecipeError(
                "invalid compile.qaic options: " + "; ".join(problems),
                hint="fix the recipe's compile.qaic section (or the --set override)",
            )

    def problems(self) -> list[str]:
        out: list[str] = []
        if not _int_at_least(self.num_cores, 1):
            out.append(f"num_cores must be a positive integer, not {self.num_cores!r}")
        for name in ("mos", "ols"):
            value = getattr(self, name)
            if value is not None and not _int_at_least(value, 1):
                out.append(f"{name} must be a positive integer or null, not {value!r}")
        if self.aic_hw_version is not None and self.aic_hw_version not in HW_VERSIONS:
            out.append(f"aic_hw_version must be one of {', '.join(HW_VERSIONS)} or null, not {self.aic_hw_version!r}")
        if not isinstance(self.devices, tuple) or not self.devices:
            out.append(f"devices must be a non-empty list of device ids, not {self.devices!r}")
        elif not all(_int_at_least(d, 0) for d in self.devices) or len(set(self.devices)) != len(self.devices):
            out.append(f"devices must be distinct non-negative integers, not {list(self.devices)!r}")
        if self.specialization_format not in SPEC_FORMATS:
            out.append(f"specialization_format must be one of {', '.join(SPEC_FORMATS)}")
        for graph in PROGRAMS:
            cores, devices = getattr(self, f"{graph}_num_cores"), getattr(self, f"{graph}_devices")
            if cores is not None and not _int_at_least(cores, 1):
                out.append(f"{graph}.num_cores must be a positive integer or null, not {cores!r}")
            if devices is not None and (
                not devices or not all(_int_at_least(d, 0) for d in devices) or len(set(devices)) != len(devices)
            ):
                out.append(f"{graph}.devices must be distinct non-negative integers or null, not {devices!r}")
        return out

    def placement(self, vision: bool = False) -> dict[str, tuple[int, tuple[int, ...]]]:
        """graph -> (cores, devices). Programs sharing a card split `num_cores` unless one sets its own: the
        pair 8 + 8 of 16; with a vision program (`vision`) target 8, draft 4, vision 4. A program alone on
        its cards gets all `num_cores`."""
        graphs = PROGRAMS if vision else PROGRAMS[:2]
        devs = {g: tuple(getattr(self, f"{g}_devices") or self.devices) for g in graphs}
        own = any(getattr(self, f"{g}_num_cores") is not None for g in graphs)
        shared = len(set.intersection(*(set(d) for d in devs.values()))) > 0
        if not own and shared and self.num_cores >= len(graphs):
            half = (self.num_cores + 1) // 2
            split = {"target": half, "draft": self.num_cores - half}
            if vision:  # the draft and the tower share the second half
                split = {"target": half, "draft": (self.num_cores - half + 1) // 2}
                split["vision"] = self.num_cores - half - split["draft"]
        else:
            split = {g: getattr(self, f"{g}_num_cores") or self.num_cores for g in graphs}
        return {g: (split[g], devs[g]) for g in graphs}

    def for_graph(self, graph: str, vision: bool = False) -> QaicCompileOptions:
        """The options one program is compiled and opened with: its own cores and devices."""
        cores, devices = self.placement(vision)[graph]
        own = {f"{g}_{k}": None for g in PROGRAMS for k in ("num_cores", "devices")}
        return replace(self, num_cores=cores, devices=devices, **own)

    def check_fit(self, cores_per_device: Mapping[int, int] | int | None, vision: bool = False) -> None:
        """Refuse placements that ask one card for more cores than it has (every program is loaded at
        once). `cores_per_device`: a card's cores, or per QID (from qaic-util); None = unknown, no check."""
        if cores_per_device is None:
            return
        users: dict[int, list[tuple[str, int]]] = {}
        for graph, (cores, devices) in self.placement(vision).items():
            for dev in devices:
                users.setdefault(dev, []).append((graph, cores))
        for dev, on_it in sorted(users.items()):
            have = cores_per_device if isinstance(cores_per_device, int) else cores_per_device.get(dev)
            need = sum(c for _, c in on_it)
            if have is not None and need > have:
                asked = " + ".join(f"{g} {c}" for g, c in on_it)
                raise BackendError(
                    f"device {dev} has {have} cores but the programs placed on it ask for {need} ({asked})",
                    hint=f"set {' and '.join(f'compile.qaic.{g}.num_cores' for g, _ in on_it)} to sum to at "
                    f"most {have}, or give the {on_it[-1][0]} its own card with compile.qaic.{on_it[-1][0]}.devices",
                )

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any] | None) -> QaicCompileOptions:
        """Build from a recipe mapping; unknown keys are an error, never silently dropped."""
        data = dict(data or {})
        data.pop("full_batch_size", None)  # shapes the exported graphs (qaic/slots.py), not a compiler flag
        for graph in PROGRAMS:  # the recipe's nested per-program sections, flattened
            section = data.pop(graph, None) or {}
            for key in ("num_cores", "devices"):
                if section.get(key) is not None:
                    data[f"{graph}_{key}"] = section[key]
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise RecipeError(
                f"unknown compile.qaic option(s): {', '.join(unknown)}",
                hint=f"known options: {', '.join(sorted(known))}",
            )
        return cls(**data)

    @property
    def num_devices(self) -> int:
        return len(self.devices)

    @property
    def kv_precision(self) -> KvPrecision:
        return "mxint8" if self.mxint8_kv_cache else "float16"

    def key_fields(self) -> dict[str, Any]:
        """What the compiled program depends on: the QIDs do not (only their count does)."""
        out = asdict(self)
        for name in ("devices", *(f"{g}_devices" for g in PROGRAMS)):
            del out[name]
        out["num_devices"] = self.num_devices
        # Which cores each program gets, and on how many cards, decide what is compiled.
        out["placement"] = {g: {"num_cores": c, "num_devices": len(d)} for g, (c, d) in self.placement().items()}
        return out


def _int_at_least(value: object, low: int) -> bool:
    # bool is an int subclass; `num_cores: true` in YAML is a mistake, not 1 core.
    return isinstance(value, int) and not isinstance(value, bool) and value >= low


@dataclass(frozen=True)
class CompilerTool:
    """How to invoke the compiler: an executable (or a shell word like "$QAIC_COMPILE")."""

    executable: str
    compile_only: bool = False  # legacy qaic-exec needs -compile-only

    @classmethod
    def from_sdk(cls, sdk: QaicSdk) -> CompilerTool:
        if sdk.compiler is None:
            raise ValueError("SDK has no compiler; call require_sdk() first")
        return cls(str(sdk.compiler), compile_only=sdk.compile_only)


def compiler_command(
    compiler: CompilerTool,
    onnx_path: str | PurePath,
    work_dir: str | PurePath,
    options: QaicCompileOptions,
    *,
    hw_version: HwVersion,
    has_local_functions: bool,
    retained_state: bool = True,
) -> list[str]:
    """argv for one graph, in the order of the SDK documentation (REFERENCE section 6).

    `work_dir` holds the side files written by specs.write_graph_inputs and receives the
    binary dir `qpc/`; it may be relative (bundles) or absolute (compile).
    """
    work = PurePath(work_dir)
    cmd = [
        compiler.executable,
        f"-m={onnx_path}",
        "-aic-hw",
        f"-aic-hw-version={hw_version}",
        *(["-retained-state"] if retained_state else []),  # the vision program keeps no state
        "-convert-to-fp16",
    ]
    if options.mxfp6_matmul:
        cmd.append("-mxfp6-matmul")
    cmd.append(f"-aic-num-cores={options.num_cores}")
    if options.mos is not None:
        cmd.append(f"-mos={options.mos}")
    if options.ols is not None:
        cmd.append(f"-ols={options.ols}")
    if options.aic_enable_depth_first:
        cmd.append("-aic-enable-depth-first")
    cmd.append(f"-network-specialization-config={work / SPECIALIZATIONS_FILE}")
    if retained_state:
        cmd.append(f"-custom-IO-list-file={work / CUSTOM_IO_FILE}")
    cmd.append(f"-aic-binary-dir={work / QPC_DIR}")
    if options.num_devices > 1:
        cmd.append(f"-mdp-load-partition-config={work / PARTITION_FILE}")
    if has_local_functions:
        cmd.append("-sub-functions")
    if compiler.compile_only:
        cmd.append("-compile-only")
    return cmd
