"""Benchmark: build a real-shaped random pair stage by stage; per stage wall time, peak RSS, cache bytes.

Each stage runs as its own `dflash build --upto STAGE` under `/usr/bin/time -v` (so its peak RSS is
its own), into a fresh cache. "new bytes" counts each file of the cache once per inode and leaves
out inodes that are the checkpoint's own files (convert hard-links them): the disk the build
actually added.

    python benchmarks/scale_build.py qwen3-0.6b --pairs /work/pairs --work /work/scale
    python benchmarks/scale_build.py llama3.1-8b --set compile.ort.precision=int4 --run-tokens 32
    python benchmarks/scale_build.py qwen3-4b --set export.dtype=fp16 --check

Writes <work>/<pair>[-tag]/report.json and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from random_pairs import PAIRS, make_pair  # noqa: E402

STAGES = ("convert", "inject", "export", "compile")
DFLASH = str(Path(sys.executable).with_name("dflash"))


def timed(cmd: list[str], log: Path) -> dict:
    """Run under /usr/bin/time -v; wall seconds, peak RSS (bytes), exit code, stdout.

    `peak_rss_bytes` is /usr/bin/time's (the largest single process); `peak_tree_rss_bytes` the largest
    sum over the whole process tree, sampled every 0.2 s (a stage or a tool it runs may start processes of its own)."""
    t0 = time.perf_counter()
    pipe = subprocess.PIPE
    with subprocess.Popen(["/usr/bin/time", "-v", *cmd], stdout=pipe, stderr=pipe, text=True) as p:
        sampler = TreeRss(p.pid)
        sampler.start()
        stdout, stderr = p.communicate()
        sampler.stop = True
        sampler.join()
    wall = time.perf_counter() - t0
    log.write_text(stdout + "\n--- stderr ---\n" + stderr)
    rss = re.search(r"Maximum resident set size \(kbytes\): (\d+)", stderr)
    return {
        "seconds": round(wall, 1),
        "peak_rss_bytes": int(rss.group(1)) * 1024 if rss else None,
        "peak_tree_rss_bytes": sampler.peak,
        "rc": p.returncode,
        "stdout": stdout,
    }


class TreeRss(threading.Thread):
    """Largest total resident memory of a process and all its descendants, polled from /proc."""

    def __init__(self, root: int) -> None:
        super().__init__(daemon=True)
        self.root, self.peak, self.stop = root, 0, False

    def run(self) -> None:
        page = os.sysconf("SC_PAGE_SIZE")
        while not self.stop:
            parents, rss = {}, {}
            for d in os.listdir("/proc"):
                if not d.isdigit():
                    continue
                try:
                    with open(f"/proc/{d}/stat") as f:
                        fields = f.read().rsplit(")", 1)[1].split()
                    with open(f"/proc/{d}/statm") as f:
                        rss[int(d)] = int(f.read().split()[1]) * page
                    parents[int(d)] = int(fields[1])
                except (OSError, IndexError, ValueError):
                    continue
            tree, grew = {self.root}, True
            while grew:
                more = {pid for pid, ppid in parents.items() if ppid in tree} - tree
                grew = bool(more)
                tree |= more
            self.peak = max(self.peak, sum(rss.get(pid, 0) for pid in tree))
            time.sleep(0.2)


def inodes(root: Path) -> dict[tuple[int, int], int]:
    found = {}
    for dirpath, _, files in os.walk(root):
        for f in files:
            st = os.stat(os.path.join(dirpath, f))
            found[(st.st_dev, st.st_ino)] = st.st_size
    return found


def write_recipe(path: Path, name: str, target: Path, draft: Path) -> None:
    from dflash_cli.families import family_for

    family = family_for(PAIRS[name][0]["model_type"]).model_type  # a text layout's type names its family
    path.write_text(
        f"# python benchmarks/scale_build.py {name}\n"
        f"name: scale-{name}\nfamily: {family}\n"
        f"target: {{path: {target}}}\ndraft: {{path: {draft}}}\n"
        "export: {ctx_len: 4096, prefill_seq_len: 128}\n"
        "run: {max_new_tokens: 32}\n"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("pair", choices=sorted(PAIRS))
    ap.add_argument("--pairs", type=Path, default=Path("/work/pairs"))
    ap.add_argument("--work", type=Path, default=Path("/work/scale"))
    ap.add_argument("--set", action="append", default=[], dest="sets")
    ap.add_argument("--tag", default="")
    ap.add_argument("--run-tokens", type=int, default=0, help="then `dflash run --json` this many tokens, both modes")
    ap.add_argument("--check", action="store_true", help="then `dflash check` (static shapes and ops)")
    ap.add_argument("--keep", action="store_true", help="keep the cache afterwards")
    args = ap.parse_args()

    target, draft = make_pair(args.pair, args.pairs)
    ckpt_bytes = sum(v for v in inodes(target).values())
    source_inodes = set(inodes(target)) | set(inodes(draft))
    work = args.work / (args.pair + (f"-{args.tag}" if args.tag else ""))
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    recipe = work / "recipe.yaml"
    write_recipe(recipe, args.pair, target, draft)
    cache = work / "cache"
    common = ["--recipe", str(recipe), "--cache-dir", str(cache), *(x for s in args.sets for x in ("--set", s))]

    rows, seen = [], set(source_inodes)
    for stage in STAGES:
        r = timed([DFLASH, "build", *common, "--upto", stage, "--json"], work / f"{stage}.log")
        now = inodes(cache)
        added = sum(size for ino, size in now.items() if ino not in seen)
        seen |= set(now)
        rows.append({"stage": stage, **{k: v for k, v in r.items() if k != "stdout"}, "new_bytes": added})
        one, tree = r["peak_rss_bytes"] / 2**30, r["peak_tree_rss_bytes"] / 2**30
        print(f"{stage:8s} rc={r['rc']} {r['seconds']:8.1f} s  peak RSS {one:6.2f} GiB (process tree {tree:6.2f} GiB)"
              f"  +{added / 2**30:6.2f} GiB", flush=True)  # fmt: skip
        if r["rc"]:
            print((work / f"{stage}.log").read_text()[-3000:])
            break
    report = {
        "pair": args.pair,
        "sets": args.sets,
        "checkpoint_bytes": ckpt_bytes,
        "stages": rows,
        "peak_rss_bytes": max(r["peak_rss_bytes"] or 0 for r in rows),
        "peak_tree_rss_bytes": max(r["peak_tree_rss_bytes"] or 0 for r in rows),
        "rss_bound_bytes": int(1.5 * ckpt_bytes + 2**30),
        "cache_new_bytes": sum(r["new_bytes"] for r in rows),
        "build_seconds": round(sum(r["seconds"] for r in rows), 1),
    }
    manifest = next((cache / "artifacts" / "export").glob("*/manifest.json"), None)
    if manifest:
        facts = json.loads(manifest.read_text())["facts"]
        report["export_seconds"] = facts.get("export_seconds")
        report["export_data_bytes"] = facts.get("data_bytes")
        report["validation"] = facts.get("validation")
    compile_manifest = next((cache / "artifacts" / "compile").glob("*/manifest.json"), None)
    if compile_manifest:
        report["compile_facts"] = json.loads(compile_manifest.read_text())["facts"]
    if args.run_tokens and all(r["rc"] == 0 for r in rows):
        runs = {}
        for mode in ("plain", "dflash", "hybrid"):
            flags = ["--no-draft"] if mode == "plain" else ["--mode", mode]
            r = timed(
                [DFLASH, "run", *common, "--prompt", "def fibonacci(n):", "--max-new-tokens", str(args.run_tokens),
                 "--json", *flags],
                work / f"run-{mode}.log",
            )  # fmt: skip
            doc = json.loads(r["stdout"]) if r["rc"] == 0 else {}
            runs[mode] = {"rc": r["rc"], "peak_rss_bytes": r["peak_rss_bytes"], "seconds": r["seconds"], **{
                k: doc.get(k) for k in ("token_ids", "tau", "decode_tokens_per_s", "new_tokens")}}  # fmt: skip
            print(f"run {mode}: rc={r['rc']} peak RSS {r['peak_rss_bytes'] / 2**30:.2f} GiB "
                  f"tau {doc.get('tau')} tok/s {doc.get('decode_tokens_per_s')}", flush=True)  # fmt: skip
        plain = runs["plain"].get("token_ids")
        runs["identical_tokens"] = plain is not None and all(
            runs[m].get("token_ids") == plain for m in ("dflash", "hybrid")
        )
        report["run"] = runs
    if args.check and all(r["rc"] == 0 for r in rows):
        r = timed([DFLASH, "check", *common, "--json", "--fp16-prompts", "0"], work / "check.log")
        report["check"] = {"rc": r["rc"], "seconds": r["seconds"], "peak_rss_bytes": r["peak_rss_bytes"]}
        print(f"check: rc={r['rc']} {r['seconds']} s", flush=True)
    (work / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps({k: v for k, v in report.items() if k != "stages"}, indent=2))
    if not args.keep:
        shutil.rmtree(cache, ignore_errors=True)


if __name__ == "__main__":
    main()
