"""Benchmark: `dflash serve` with continuous batching against one request at a time, and every answer checked.

    .venv/bin/python benchmarks/serve_batching.py --recipe demo --modes plain,dflash,hybrid \
        --max-batch 1,4 --clients 1,2,4,8 --requests 32 --max-tokens 64

For each mode and --max-batch, starts `dflash serve` (any free port) and, for each number of clients,
sends the first --requests HumanEval prompts as streamed /v1/completions: each client thread takes the
next prompt after a random pause of 0-200 ms (seeded: requests arrive at random times) until all are
answered. Reports total output tokens/s (all tokens / wall time from the first send to the last answer)
and p50/p99 time per output token after the first, per request; and checks every answer's text against
the same prompt decoded alone by this process's engine (`dflash run`'s), greedy or with the same seed.
Writes JSON and a Markdown table to --out.

`--emulate STEP_COST.json --emulate-t1-ms T`: the server's calls cost what another model's do
(emulated_costs.py; batched calls by their total rows), e.g. the demo pair's acceptance at the 4B shape's
int4 costs. Then a mode `hybrid-own` is the hybrid charging verify time at each request's own rate, not at
that of every sequence sharing the call, and `dflash-always` DFlash drafting at every step whatever the load
(the A/B arms of those rules).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
from serve_load import percentile, stream_request  # noqa: E402


def start_server(recipe: str, cache_dir: str | None, sets: list[str], max_batch: int, mode: str, emulate=None):
    """`emulate`: (STEP_COST.json, T1 ms) for emulated_costs.py; a mode ending in -own or -always is an A/B arm
    (the module docstring)."""
    import re

    flags = {"-own": "--own-rate", "-always": "--always-draft"}
    arm = [flag for suffix, flag in flags.items() if mode.endswith(suffix)]
    mode = base_mode(mode)
    cmd = [sys.executable, "-m", "dflash_cli"]
    if arm and not emulate:
        raise SystemExit(f"mode {mode} with {arm[0]} needs --emulate")
    if emulate:
        wrapper = [str(ROOT / "benchmarks/emulated_costs.py"), str(emulate[0]), str(emulate[1])]
        cmd = [sys.executable, *wrapper, *arm, "--"]
    cmd += ["serve", "-r", recipe, "--port", "0", "--max-batch", str(max_batch)]
    cmd += ["--queue-size", "64"] + (["--cache-dir", cache_dir] if cache_dir else [])
    cmd += [x for s in sets for x in ("--set", s)]
    if mode == "plain":
        cmd.append("--no-draft")
    else:
        cmd += ["--set", f"run.drafter={'hybrid' if mode == 'hybrid' else 'dflash'}"]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    notes = []
    while True:
        line = proc.stderr.readline()
        if not line and proc.poll() is not None:
            raise SystemExit(f"server exited with {proc.returncode} before listening")
        if line.startswith("note:"):
            notes.append(line.strip())
        found = re.search(r"http://\S+/v1", line)
        if found:
            threading.Thread(target=proc.stderr.read, daemon=True).start()  # keep its pipe drained
            return proc, found.group(0)[: -len("/v1")], notes


def base_mode(mode: str) -> str:
    """The decoding mode of a benchmark mode (`hybrid-own`, `dflash-always`: an A/B arm of it)."""
    return mode.removesuffix("-own").removesuffix("-always")


def load(url: str, prompts: list[str], clients: int, body: dict, seed: int) -> dict:
    pending = list(range(len(prompts)))
    out: list[dict | None] = [None] * len(prompts)
    lock = threading.Lock()
    rng = random.Random(seed)
    pauses = [rng.uniform(0.0, 0.2) for _ in prompts]

    def client() -> None:
        while True:
            with lock:
                if not pending:
                    return
                k = pending.pop(0)
            time.sleep(pauses[k])
            out[k] = stream_request(url + "/v1/completions", {**body, "prompt": prompts[k]})

    t0 = time.perf_counter()
    threads = [threading.Thread(target=client) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    tpot = [r["decode_s"] / (r["tokens"] - 1) * 1000 for r in out if r and r["tokens"] > 1 and r["decode_s"]]
    return {
        "clients": clients,
        "wall_s": wall,
        "tokens": sum(r["tokens"] for r in out if r),
        "output_tok_s": sum(r["tokens"] for r in out if r) / wall,
        "p50_tpot_ms": percentile(tpot, 50),
        "p99_tpot_ms": percentile(tpot, 99),
        "p50_ttft_ms": percentile([r["ttft_s"] * 1000 for r in out if r and r["ttft_s"] is not None], 50),
        "failed": sum(1 for r in out if not r or r["status"] != 200),
        "texts": [r["text"] if r else None for r in out],
    }


def load_options(doc: str) -> argparse.ArgumentParser:
    """The options this script and serve_guidellm.py share: the server's build and the load."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--recipe", default="demo")
    ap.add_argument("--cache-dir")
    ap.add_argument("--set", action="append", default=[], dest="sets")
    ap.add_argument("--max-batch", default="1,4")
    ap.add_argument("--clients", default="1,2,4,8")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--seed", type=int, default=5)
    return ap


def main() -> None:
    ap = load_options(__doc__)
    ap.add_argument("--modes", default="plain,dflash,hybrid")
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/serve-batching")
    ap.add_argument("--emulate", type=Path, help="graph_step_cost.py JSON the server's calls are padded to")
    ap.add_argument("--emulate-t1-ms", type=float, default=20.0)
    ap.add_argument("--name", help="the results' file name (default: the recipe's)")
    args = ap.parse_args()

    from dflash_cli.bench import load_dataset
    from dflash_cli.cache.store import Cache
    from dflash_cli.decoding.engine import Engine
    from dflash_cli.recipe.schema import load_recipe

    prompts = [s.turns[0] for s in load_dataset("humaneval", max_samples=args.requests, seed=args.seed)]
    engine = Engine.load(load_recipe(args.recipe, args.sets), Cache(args.cache_dir))
    body = {"max_tokens": args.max_tokens, "temperature": args.temperature, "seed": args.seed}
    modes = args.modes.split(",")
    alone: dict[str, list[str]] = {}
    for mode in {base_mode(m) for m in modes}:  # each prompt decoded alone, as `dflash run` does
        alone[mode] = []
        for p in prompts:
            ids = engine.encode_prompt(p)
            r = engine.generate(
                ids, mode=mode, max_new_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed
            )
            alone[mode].append(engine.decode(r.tokens))
    del engine
    rows = []
    for mode in modes:
        for batch in [int(b) for b in args.max_batch.split(",")]:
            emulate = (args.emulate, args.emulate_t1_ms) if args.emulate else None
            proc, url, notes = start_server(args.recipe, args.cache_dir, args.sets, batch, mode, emulate)
            try:
                stream_request(url + "/v1/completions", {**body, "prompt": prompts[0]})  # warm-up
                for clients in [int(c) for c in args.clients.split(",")]:
                    res = load(url, prompts, clients, body, args.seed)
                    texts = res.pop("texts")
                    res.update(mode=mode, max_batch=batch, notes=notes)
                    res["identical"] = sum(t == a for t, a in zip(texts, alone[base_mode(mode)]))
                    rows.append(res)
                    print(json.dumps(res), flush=True)
            finally:
                proc.terminate()
                proc.wait(60)
    args.out.mkdir(parents=True, exist_ok=True)
    name = args.name or Path(args.recipe).stem + ("-sampled" if args.temperature > 0 else "")
    doc = {
        "recipe": args.recipe,
        "sets": args.sets,
        "requests": args.requests,
        "max_tokens": args.max_tokens,
        "temperature": args.temperature,
        "emulate": [str(args.emulate), args.emulate_t1_ms] if args.emulate else None,
        "rows": rows,
    }
    (args.out / f"{name}.json").write_text(json.dumps(doc, indent=1))
    base = {(r["mode"], r["clients"]): r["output_tok_s"] for r in rows if r["max_batch"] == 1}
    lines = [
        "| mode | max batch | clients | output tok/s | vs one at a time | p50 / p99 TPOT ms | p50 TTFT ms "
        "| identical |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        ratio = r["output_tok_s"] / base[(r["mode"], r["clients"])] if (r["mode"], r["clients"]) in base else None
        lines.append(
            f"| {r['mode']} | {r['max_batch']} | {r['clients']} | {r['output_tok_s']:.1f} | "
            f"{'' if ratio is None else f'{ratio:.2f}x'} | {r['p50_tpot_ms']:.1f} / {r['p99_tpot_ms']:.1f} | "
            f"{r['p50_ttft_ms']:.0f} | {r['identical']}/{args.requests} |"
        )
    (args.out / f"{name}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    print("median output tok/s over rows:", statistics.median(r["output_tok_s"] for r in rows))


if __name__ == "__main__":
    main()
