"""Where a plain decode step's time goes, per ONNX Runtime op type, on a random pair's real build.

    python benchmarks/step_profile.py --pair /work/pairs/qwen3-0.6b --work W --precision int4 \
        [--prompt-len 100] [--new 64] [--out F.txt]

Builds the pair as `benchmarks/peers_decode.py` does (ctx_len 1024, in W), decodes `--new` tokens plain
from a prompt of `--prompt-len` ids with ONNX Runtime's profiler on, and prints, for the target's one-token
calls, the sum over nodes of each node's median kernel time, grouped by op type. The profiler adds a few
microseconds to every node, so small ops read high; the median whole call (profiled) is printed beside it.
"""

from __future__ import annotations

import argparse
import collections
import json
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def profiled_plain(pair: Path, work: Path, precision: str, prompt_len: int, new: int, out_dir: Path) -> Path:
    """Decode with every session profiled; the target's profile file (the one with the most calls)."""
    from peers_decode import dflash_engine

    import dflash_cli.backends.ort as ort_backend

    dflash_engine(pair, work, precision, True, 32)  # built, and its checks run, before profiling starts
    plain_options = ort_backend.session_options

    def profiling(settings, initializers=None):
        opts = plain_options(settings, initializers)
        opts.enable_profiling = True
        opts.profile_file_prefix = str(out_dir / "session")
        return opts

    ort_backend.session_options = profiling
    engine = dflash_engine(pair, work, precision, True, 32)
    engine.generate(list(range(1000, 1000 + prompt_len)), mode="plain", max_new_tokens=new)
    del engine  # ends the sessions, which writes their profiles
    import gc

    gc.collect()
    files = sorted(out_dir.glob("session*.json"), key=lambda f: f.stat().st_size)
    if not files:
        raise SystemExit("ONNX Runtime wrote no profile")
    return files[-1]


def per_op(profile: Path) -> tuple[float, dict[str, tuple[float, int]]]:
    """(median call ms, op type -> (sum of its nodes' median kernel ms, node count)) over decode calls.
    Medians per node leave out the first calls (pages faulted in, the build's checks) without picking them."""
    events = json.loads(profile.read_text())
    calls = [e["dur"] for e in events if e.get("name") == "model_run"]
    times: dict[tuple[str, str], list[int]] = collections.defaultdict(list)
    for e in events:
        if e.get("cat") == "Node" and e["name"].endswith("_kernel_time"):
            times[(e["args"]["op_name"], e["name"])].append(e["dur"])
    ops: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0])
    for (op, _), durations in times.items():
        ops[op][0] += statistics.median(durations) / 1e3
        ops[op][1] += 1
    return statistics.median(calls) / 1e3, {k: (v[0], int(v[1])) for k, v in ops.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pair", type=Path, required=True, help="a random pair (benchmarks/random_pairs.py)")
    ap.add_argument("--work", type=Path, required=True, help="where the build's recipe and cache live")
    ap.add_argument("--precision", default="int4", choices=("fp32", "int8", "int4"))
    ap.add_argument("--prompt-len", type=int, default=100)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--profile", type=Path, help="read this ONNX Runtime profile (a target's) instead of decoding")
    args = ap.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    if args.profile:
        call_ms, ops = per_op(args.profile)
    else:
        with tempfile.TemporaryDirectory() as tmp:
            profile = profiled_plain(args.pair, args.work, args.precision, args.prompt_len, args.new, Path(tmp))
            call_ms, ops = per_op(profile)
    total = sum(ms for ms, _ in ops.values())
    lines = [
        f"{args.pair.name} {args.precision}, plain, prompt {args.prompt_len} + {args.new} new: median call "
        f"{call_ms:.2f} ms (profiled); sum of per-node medians {total:.2f} ms",
    ]
    for op, (ms, count) in sorted(ops.items(), key=lambda kv: -kv[1][0]):
        lines.append(f"  {op:30s} {ms:8.3f} ms  {count:4d} nodes  {ms / count * 1e3:7.1f} us a node")
    print("\n".join(lines))
    if args.out:
        args.out.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
