"""DFlash on a CPU in dflash and in the other engines that run DFlash drafts, side by side on one pair.

For each HumanEval prompt (the ids dflash's tokenizer gives, no template: what `dflash bench --dataset humaneval`
sends the demo pair), in rotating order, greedy, stopping at end of text or --new tokens:

* dflash: plain, DFlash, lookup and hybrid (the recipe's default drafter), one engine in this process;
* openvino-genai: plain, and its DFlash pipeline with the same draft exported by optimum-intel's DFlash exporter
  (`ov_dflash_export.py`), each a worker process (`ov_genai_worker.py`) in the OpenVINO GenAI venv;
* llama.cpp: plain, and its DFlash (`--spec-type draft-dflash`), each a `llama-server` of the vendored tree,
  the pair converted by that tree's own converter (`llama_server_peer.py`).

Reported per engine and mode: decode tok/s (new tokens after the first over decode time, summed over prompts),
median TTFT, tokens per target call after the prompt's (tau) where the engine counts its calls, peak RSS of the
process that holds the models, and how many prompts' speculative output equals that engine's own plain output.
One JSON per engine under --out-dir. A mode an engine cannot run is recorded with the reason it gave.

    PEERS_OPENVINO_GENAI=1 bash benchmarks/peers_setup.sh
    .bench-venv/bin/python benchmarks/peers_dflash.py --openvino-genai .bench-ov-venv/bin/python \\
        --llama-bin LLAMA_BUILD/bin --llama-src LLAMA_SRC --work /tmp/peers-dflash
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

from llama_server_peer import LlamaServer, gguf, quantised
from llama_server_peer import version as llama_version
from peers_decode import OvGenAIWorker, ov_genai_model

ROOT = Path(__file__).resolve().parents[1]
MODELS = ROOT / "dflash_cli" / "shipped" / "models"


def dflash_runner(recipe: str, sets: list[str], ignore_eos: bool):
    from dflash_cli.cache.store import Cache
    from dflash_cli.decoding.engine import build_engine
    from dflash_cli.recipe.schema import load_recipe

    engine = build_engine(load_recipe(recipe, sets), Cache())

    def run(mode: str, ids: list[int], new: int) -> dict:
        r = engine.generate(ids, mode=mode, max_new_tokens=new, ignore_eos=ignore_eos)
        return {"tokens": r.tokens, "ttft_s": r.prefill_s, "decode_s": r.decode_s, "calls": len(r.accept_lengths)}

    return engine, run


def ov_runners(python: str, work: Path, target: Path, draft: Path, block: int, precision: str, eos: bool) -> dict:
    ov_target = ov_genai_model(python, target, work / f"ov-target-{precision}", precision)
    ov_draft = work / f"ov-dflash-draft-{precision}"
    if not (ov_draft / "openvino_model.xml").is_file():
        export = [python, str(Path(__file__).with_name("ov_dflash_export.py")), str(draft), str(ov_draft)]
        subprocess.run(export + ([precision] if precision != "fp32" else []), check=True)
    # Prefix caching off in both (its DFlash pipeline asks for it off): a prompt sharing a cached prefix with an
    # earlier one would otherwise reuse K/V computed in other chunks, and plain's numbers would depend on the order.
    workers = {"plain": OvGenAIWorker(python, ov_target, extra=("--no-prefix-caching",))}
    workers["dflash"] = OvGenAIWorker(python, ov_target, draft=ov_draft, extra=("--no-prefix-caching",))

    def runner(mode: str):
        def run(_mode: str, ids: list[int], new: int) -> dict:
            w = workers[mode]
            tokens, ttft, decode = w.run(ids, new, ignore_eos=eos, assistant_tokens=block - 1 if mode != "plain" else 0)
            calls = w.last.get("target_calls", len(tokens)) - 1  # its counts include the prompt's call
            return {"tokens": tokens, "ttft_s": ttft, "decode_s": decode, "calls": calls}

        return run

    return {m: (runner(m), workers[m].proc.pid) for m in workers}


def rss(pid: int) -> int | None:
    try:
        line = next(x for x in Path(f"/proc/{pid}/status").read_text().splitlines() if x.startswith("VmHWM:"))
        return int(line.split()[1]) * 1024
    except (OSError, StopIteration):
        return None


def summary(rows: list[dict], mode: str, plain: str | None) -> dict:
    done = [r[mode] for r in rows if mode in r]
    new = sum(max(0, len(d["tokens"]) - 1) for d in done)
    out = {
        "prompts": len(done),
        "new_tokens": sum(len(d["tokens"]) for d in done),
        "decode_tok_s": round(new / sum(d["decode_s"] for d in done), 1),
        "ttft_ms_median": round(1000 * statistics.median(d["ttft_s"] for d in done), 2),
    }
    if all("calls" in d for d in done):
        out["tokens_per_target_call"] = round(new / max(1, sum(d["calls"] for d in done)), 3)
    if plain:
        same = sum(r[mode]["tokens"] == r[plain]["tokens"] for r in rows if mode in r and plain in r)
        out["prompts_equal_to_own_plain"] = f"{same}/{len(done)}"
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--recipe", default="demo")
    ap.add_argument("--set", dest="sets", action="append", default=[], help="a dflash recipe override")
    ap.add_argument("--target", type=Path, default=MODELS / "demo-target")
    ap.add_argument("--draft", type=Path, default=MODELS / "demo-draft")
    ap.add_argument("--samples", type=int, default=164)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--openvino-genai", metavar="PYTHON", help="the OpenVINO GenAI venv's python; adds it")
    ap.add_argument("--llama-bin", type=Path, help="a llama.cpp build's bin/ (llama-server); adds llama.cpp")
    ap.add_argument("--llama-src", type=Path, help="its source tree (convert_hf_to_gguf.py)")
    ap.add_argument("--llama-args", default="", help="more llama-server flags, e.g. --no-repack")
    ap.add_argument("--name", default="demo", help="the pair's name in the result files")
    ap.add_argument(
        "--precision", default="fp32", choices=("fp32", "int4"), help="the peers' weights (int4: NNCF group 32, q4_0)"
    )
    ap.add_argument("--step-times", type=int, default=0, help="also dflash's per-call medians over N calls")
    ap.add_argument("--ignore-eos", action="store_true", help="every answer --new tokens (random weights)")
    ap.add_argument("--out-dir", type=Path, default=ROOT / "benchmarks" / "results" / "peers-dflash")
    args = ap.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    from dflash_cli.bench.datasets import load_dataset

    engine, run_dflash = dflash_runner(args.recipe, args.sets, args.ignore_eos)
    block = engine.block_size
    modes: dict[str, tuple] = {
        f"dflash {m}": ("dflash", run_dflash, m) for m in ("plain", "dflash", "lookup", "hybrid")
    }
    engines = {"dflash": {"pid": None, "version": _git_rev(), "failures": {}}}
    if args.openvino_genai:
        ov = ov_runners(args.openvino_genai, args.work, args.target, args.draft, block, args.precision, args.ignore_eos)
        for m, (run, _pid) in ov.items():
            modes[f"openvino-genai {m}"] = ("openvino-genai", run, m)
        ver = subprocess.run(
            [args.openvino_genai, "-c", "import openvino_genai as g; print(g.__version__)"],
            capture_output=True,
            text=True,
        ).stdout.strip()
        engines["openvino-genai"] = {"pids": {m: pid for m, (_, pid) in ov.items()}, "version": ver, "failures": {}}
    servers = {}
    if args.llama_bin:
        quant = "q4_0" if args.precision == "int4" else "f32"
        target = gguf(args.llama_src, args.target, args.work / "llama-target-f32.gguf")
        draft = gguf(args.llama_src, args.draft, args.work / "llama-draft-f32.gguf", target=args.target)
        target, draft = (quantised(args.llama_bin, f, quant) for f in (target, draft))
        engines["llama.cpp"] = {"pids": {}, "version": llama_version(args.llama_bin), "failures": {}}
        engines["llama.cpp"]["flags"] = args.llama_args
        for m, d in (("plain", None), ("dflash", draft)):
            log = args.work / f"llama-{m}.log"
            s = LlamaServer(args.llama_bin, target, log, draft=d, block=block, extra=tuple(args.llama_args.split()))
            servers[m] = s
            engines["llama.cpp"]["pids"][m] = s.proc.pid
            modes[f"llama.cpp {m}"] = ("llama.cpp", lambda _m, ids, new, s=s: s.run(ids, new, args.ignore_eos), m)

    samples = load_dataset("humaneval", max_samples=args.samples)
    rows: list[dict] = []
    names = list(modes)
    eos = set(engine.eos_token_ids)
    t0 = time.time()
    for k, sample in enumerate(samples):
        ids = engine.encode_prompt(sample.turns[0])
        order = names[k % len(names) :] + names[: k % len(names)]
        row = {}
        # Before the first prompt, each mode once on its ids reversed (not counted): first calls pay for
        # allocation, and an engine with a prefix cache (openvino-genai's) must not be handed a prompt it has seen.
        warm = [(name, ids[::-1], False) for name in order] if k == 0 else []
        for name, prompt, counted in warm + [(name, ids, True) for name in order]:
            kind, run, mode = modes[name]
            if mode in engines[kind]["failures"]:
                continue
            try:
                out = run(mode, prompt, args.new)
            except Exception as exc:  # a peer that cannot run this mode: its reason, and on without it
                engines[kind]["failures"][mode] = str(exc)[:300]
                continue
            while out["tokens"] and out["tokens"][-1] in eos:  # engines differ on keeping it
                out["tokens"] = out["tokens"][:-1]
            if counted:
                row[name] = out
        rows.append(row)
        if (k + 1) % 10 == 0:
            print(f"{k + 1}/{len(samples)} prompts, {time.time() - t0:.0f} s", flush=True)

    args.out_dir.mkdir(parents=True, exist_ok=True)
    for kind, info in engines.items():
        doc = {"engine": kind, "version": info["version"], "pair": args.name, "samples": len(rows)}
        doc |= {"flags": info["flags"]} if info.get("flags") else {}
        doc |= {"new_tokens_max": args.new, "block_size": block, "threads": 2, "modes": {}}
        for name, (k2, _, mode) in modes.items():
            if k2 != kind:
                continue
            if mode in info["failures"]:
                doc["modes"][mode] = {"cannot_run": info["failures"][mode]}
                continue
            doc["modes"][mode] = summary(rows, name, None if mode == "plain" else f"{kind} plain")
        if kind == "dflash":
            doc["peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
            if args.step_times:  # T(1), the verify curve and the draft call, warm (decoding/step_times.py)
                doc["step_times_s"] = engine.step_times(repeats=args.step_times)
        else:
            doc["peak_rss_bytes"] = {m: rss(pid) for m, pid in info["pids"].items()}
        if kind == "openvino-genai":
            doc["modes"]["plain"]["prompts_equal_to_dflash_plain"] = _same(rows, "openvino-genai plain", "dflash plain")
        if kind == "llama.cpp" and "plain" in doc["modes"] and "cannot_run" not in doc["modes"]["plain"]:
            doc["modes"]["plain"]["prompts_equal_to_dflash_plain"] = _same(rows, "llama.cpp plain", "dflash plain")
        path = args.out_dir / f"{args.name}-{kind}.json"
        path.write_text(json.dumps(doc, indent=2) + "\n")
        print(json.dumps(doc, indent=2))
    for s in servers.values():
        s.close()


def _same(rows: list[dict], a: str, b: str) -> str:
    both = [r for r in rows if a in r and b in r]
    return f"{sum(r[a]['tokens'] == r[b]['tokens'] for r in both)}/{len(both)}"


def _git_rev() -> str:
    out = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return f"dflash {out.stdout.strip()}"


if __name__ == "__main__":
    sys.exit(main())
