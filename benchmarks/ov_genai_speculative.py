"""openvino-genai's own speculative decoding beside dflash's, on the demo pair's trained target and HumanEval.

openvino-genai speculates with an ordinary autoregressive draft model. No such draft exists for the demo
target, so this one is made from the target itself: its first --draft-layers decoder layers with its final
norm and (tied) head, the usual self-speculative construction, optionally trained on for --finetune-steps
steps of the target's own training loop and corpus; a DFlash draft cannot serve, it is not a causal
language model. Per prompt, in rotating order: dflash plain, dflash DFlash, openvino-genai plain,
openvino-genai speculative (--assistant-tokens proposals per step), all greedy from the same prompt ids,
128 new tokens, stopping at end of text. Reported: decode tok/s (after the first token), each engine's
speculative speedup over its own plain decode (total and per-prompt geomean), and token agreement.

    PEERS_OPENVINO_GENAI=1 bash benchmarks/peers_setup.sh
    .bench-venv/bin/python benchmarks/ov_genai_speculative.py --openvino-genai .bench-ov-venv/bin/python \\
        --work /tmp/ov-spec --out benchmarks/results/peers/demo-openvino-genai-speculative.json
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

from peers_decode import OvGenAIWorker, ov_genai_model

ROOT = Path(__file__).resolve().parents[1]


def truncated_target(target: Path, layers: int, out: Path) -> Path:
    """The target's first `layers` decoder layers, final norm and head, as a Hugging Face checkpoint."""
    from safetensors.torch import load_file, save_file

    if (out / "config.json").is_file():
        return out
    out.mkdir(parents=True, exist_ok=True)
    config = json.loads((target / "config.json").read_text())
    config["num_hidden_layers"] = layers
    config["layer_types"] = config["layer_types"][:layers]
    keep = {}
    for name, tensor in load_file(target / "model.safetensors").items():
        parts = name.split(".")
        if parts[:2] == ["model", "layers"] and int(parts[2]) >= layers:
            continue
        keep[name] = tensor
    save_file(keep, out / "model.safetensors", metadata={"format": "pt"})
    for name in ("generation_config.json", "tokenizer.json", "tokenizer_config.json", "training.json"):
        shutil.copy(target / name, out / name)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


def finetuned(draft: Path, steps: int, work: Path) -> Path:
    """The truncated draft trained on for `steps` more steps of the demo target's own loop and corpus."""
    out = work / f"{draft.name}-ft{steps}"
    if not (out / "training.json").is_file():
        cmd = [sys.executable, "-m", "dflash_cli.demo.train_target", "--init-from", str(draft), "--out", str(out)]
        cmd += ["--work-dir", str(work / f"train-{out.name}"), "--steps", str(steps), "--threads", "2"]
        cmd += ["--lr", "1e-3", "--warmup", "20", "--run-name", "draft"]
        subprocess.run(cmd, check=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--openvino-genai", metavar="PYTHON", required=True, help="the openvino-genai venv's python")
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--samples", type=int, default=40)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--draft-layers", type=int, default=2)
    ap.add_argument("--assistant-tokens", type=int, default=4)
    ap.add_argument("--finetune-steps", type=int, default=0, help="train the truncated draft on (0: as cut)")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()

    from dflash_cli.bench.datasets import load_dataset
    from dflash_cli.cache.store import Cache
    from dflash_cli.decoding.engine import build_engine
    from dflash_cli.recipe.schema import load_recipe

    recipe = load_recipe("demo", [])
    engine = build_engine(recipe, Cache())
    target = ROOT / "models" / "demo-target"
    draft = truncated_target(target, args.draft_layers, args.work / f"draft-{args.draft_layers}-layers")
    draft = finetuned(draft, args.finetune_steps, args.work) if args.finetune_steps else draft
    py = args.openvino_genai
    ov_target = ov_genai_model(py, target, args.work / "ov-target", "fp32")
    ov_draft = ov_genai_model(py, draft, args.work / f"ov-{draft.name}", "fp32")
    ov_plain = OvGenAIWorker(py, ov_target)
    ov_spec = OvGenAIWorker(py, ov_target, draft=ov_draft)

    def run(mode: str, ids: list[int]) -> tuple[list[int], float, int]:
        """Tokens, decode seconds and target calls after the prompt's (steps)."""
        if mode.startswith("dflash"):
            r = engine.generate(ids, mode=mode.split()[1], max_new_tokens=args.tokens)
            return r.tokens, r.decode_s, len(r.accept_lengths)
        worker, k = (ov_plain, 0) if mode.endswith("plain") else (ov_spec, args.assistant_tokens)
        tokens, _, decode_s = worker.run(ids, args.tokens, ignore_eos=False, assistant_tokens=k)
        return tokens, decode_s, worker.last.get("target_calls", len(tokens)) - 1

    modes = ["dflash plain", "dflash dflash", "openvino-genai plain", "openvino-genai speculative"]
    samples = load_dataset("humaneval", max_samples=args.samples)
    rows = []
    for k, sample in enumerate(samples):
        ids = engine.encode_prompt(sample.turns[0])
        if k == 0:
            for mode in modes:  # warm-up, not counted
                run(mode, ids)
        order = modes[k % len(modes) :] + modes[: k % len(modes)]
        rows.append({mode: run(mode, ids) for mode in order})
        if (k + 1) % 10 == 0:
            print(f"{k + 1}/{len(samples)} prompts", flush=True)

    report = {"samples": len(rows), "tokens": args.tokens, "draft_layers": args.draft_layers}
    report |= {"assistant_tokens": args.assistant_tokens, "finetune_steps": args.finetune_steps}
    for mode in modes:
        tokens = sum(len(row[mode][0]) - 1 for row in rows)
        steps = sum(row[mode][2] for row in rows) or 1
        report[mode] = {"decode_tok_s": round(tokens / sum(row[mode][1] for row in rows), 1)}
        report[mode]["tokens_per_target_call"] = round(tokens / steps, 3)
    for fast, plain in (("dflash dflash", "dflash plain"), ("openvino-genai speculative", "openvino-genai plain")):
        logs = [math.log(row[plain][1] / row[fast][1]) for row in rows if row[fast][1] > 0 and row[plain][1] > 0]
        report[f"{fast} over plain"] = {
            "total": round(report[fast]["decode_tok_s"] / report[plain]["decode_tok_s"], 3),
            "geomean": round(math.exp(statistics.mean(logs)), 3),
        }
    same = {
        "dflash dflash == dflash plain": ("dflash dflash", "dflash plain"),
        "openvino-genai speculative == its plain": ("openvino-genai speculative", "openvino-genai plain"),
        "openvino-genai plain == dflash plain": ("openvino-genai plain", "dflash plain"),
    }
    for label, (a, b) in same.items():
        report[label] = f"{sum(row[a][0] == row[b][0] for row in rows)}/{len(rows)} prompts"
    print(json.dumps(report, indent=2))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
