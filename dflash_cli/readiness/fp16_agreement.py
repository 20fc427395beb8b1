"""fp16 emulation end to end: greedy DFlash with fp16-converted graphs vs the fp32 build, per prompt."""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dflash_cli.readiness.fp16 import NonfiniteWatch, to_fp16


@dataclass
class Fp16Agreement:
    prompts: int = 0
    identical: int = 0
    nonfinite: dict[str, int] = field(default_factory=dict)
    first_divergence: list[int | None] = field(default_factory=list)  # per prompt: position or None
    # per diverging prompt: index, position, both tokens, and (with a gap function) the fp32 logit gap
    divergences: list[dict[str, Any]] = field(default_factory=list)

    @property
    def rate(self) -> float:
        return self.identical / self.prompts if self.prompts else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "prompts": self.prompts,
            "identical": self.identical,
            "rate": self.rate,
            "nonfinite": self.nonfinite,
            "first_divergence": self.first_divergence,
            "divergences": self.divergences,
            "max_divergence_gap": max((d["gap"] for d in self.divergences if "gap" in d), default=None),
        }


def fp16_agreement(
    engine: Any,
    export_dir: Path,
    prompts: list[list[int]],
    max_new_tokens: int,
    progress: Callable[[int, int], None] | None = None,
    logit_gap: Callable[[list[int], int, int], dict[str, Any]] | None = None,
) -> Fp16Agreement:
    """Run greedy DFlash on each prompt with the fp32 engine, then with fp16 graphs, and compare.

    With `logit_gap` (see `readiness.logit_gap.LogitGap`), each divergence also records the fp32
    logit gap between the two tokens at the first differing position.
    """
    import json

    from dflash_cli.backends.ort import OrtSession

    info = json.loads((Path(export_dir) / "export.json").read_text())
    result = Fp16Agreement()
    fp32 = (engine.target, engine.draft)
    with tempfile.TemporaryDirectory(prefix="dflash-fp16-") as tmp:
        sessions = {}
        for g in ("target", "draft"):
            path = to_fp16(Path(export_dir) / info["graphs"][g]["onnx"], Path(tmp) / f"{g}.onnx")
            sessions[g] = NonfiniteWatch(OrtSession(path, g), result.nonfinite, prefix=f"{g}:")
        for i, ids in enumerate(prompts):
            engine.target, engine.draft = fp32
            ref = engine.generate(ids, mode="dflash", max_new_tokens=max_new_tokens).tokens
            engine.target, engine.draft = sessions["target"], sessions["draft"]
            try:
                got = engine.generate(ids, mode="dflash", max_new_tokens=max_new_tokens).tokens
            finally:
                engine.target, engine.draft = fp32
            result.prompts += 1
            if got == ref:
                result.identical += 1
                result.first_divergence.append(None)
            else:
                j = next((j for j, (a, b) in enumerate(zip(got, ref)) if a != b), min(len(got), len(ref)))
                result.first_divergence.append(j)
                if j < min(len(got), len(ref)):  # a differing token, not just a different length
                    d: dict[str, Any] = {"prompt": i, "position": j, "fp32_token": ref[j], "fp16_token": got[j]}
                    if logit_gap is not None:
                        d.update(logit_gap(list(ids) + ref[:j], ref[j], got[j]))
                    result.divergences.append(d)
            if progress:
                progress(i + 1, len(prompts))
    return result
