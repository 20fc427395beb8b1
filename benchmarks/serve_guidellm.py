"""Benchmark: `dflash serve` under GuideLLM (PyPI `guidellm`, in a venv of its own: benchmarks/client_setup.sh).

    .venv/bin/python benchmarks/serve_guidellm.py --recipe demo --max-batch 1,4 --clients 1,2,4,8 \
        --requests 32 --max-tokens 64 [--client-venv .client-venv] [--out benchmarks/results/serve-guidellm]

For each --max-batch, starts `dflash serve` in --mode (any free port) and, for each number of clients,
runs `guidellm run` with a concurrent profile of that many streams over the first --requests HumanEval prompts
(a JSONL file with each prompt and its output token count), streamed /v1/completions, stopping after
--requests requests. GuideLLM's own JSON report is kept per run; the summary table takes from it the output
tokens/s, the median and p99 inter-token latency and time to first token, as GuideLLM measured them.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
from serve_batching import load_options, start_server  # noqa: E402


def scenario(url: str, model: str, data: Path, tokenizer: Path, clients: int, requests: int, report: Path) -> dict:
    return {
        "spec": {
            "backend": {"kind": "openai_http", "target": url, "model": model, "request_format": "/v1/completions"},
            "profile": {"kind": "concurrent", "streams": [clients]},
            "data": [{"kind": "json_file", "path": str(data)}],
            "tokenizer": {"kind": "huggingface_auto", "model": str(tokenizer)},
            "constraints": [{"kind": "max_requests", "count": requests}],
            "outputs": [{"kind": "json", "path": str(report)}],
        }
    }


def summary(report: Path) -> dict:
    """Output tokens/s (all output tokens over the benchmark's measured duration) and latencies from
    GuideLLM's report: its percentiles of inter-token latency and time to first token, read where they are."""
    bench = json.loads(report.read_text())["benchmarks"][0]
    metrics, made = bench["metrics"], bench["scheduler_metrics"]["requests_made"]
    if made["errored"] or made["incomplete"]:
        raise SystemExit(f"{report}: {made['errored']} requests errored, {made['incomplete']} incomplete")

    def stat(name: str, key: str) -> float:
        dist = metrics[name]["successful"]
        return dist[key] if key in dist else dist["percentiles"][key]

    return {
        "output_tok_s": stat("output_token_count", "total_sum") / bench["duration"],
        "p50_itl_ms": stat("inter_token_latency_ms", "median"),
        "p99_itl_ms": stat("inter_token_latency_ms", "p99"),
        "p50_ttft_ms": stat("time_to_first_token_ms", "median"),
        "requests": made["successful"],
        "output_tokens": stat("output_token_count", "total_sum"),
    }


def main() -> None:
    ap = load_options(__doc__)
    ap.add_argument("--mode", default="dflash", choices=("plain", "dflash", "hybrid"), help="plain: a random pair's")
    ap.add_argument("--client-venv", type=Path, default=ROOT / ".client-venv")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/serve-guidellm")
    args = ap.parse_args()
    guidellm = args.client_venv / "bin" / "guidellm"
    if not guidellm.exists():
        raise SystemExit(f"no {guidellm}: run `bash benchmarks/client_setup.sh` first")

    from dflash_cli.bench import load_dataset
    from dflash_cli.cache.store import Cache
    from dflash_cli.recipe.schema import load_recipe
    from dflash_cli.stages.pipeline import artifact_path

    recipe = load_recipe(args.recipe, args.sets)
    tokenizer = artifact_path(recipe, Cache(args.cache_dir), "inject") / "target"  # the one the server uses
    out = args.out / Path(args.recipe).stem
    out.mkdir(parents=True, exist_ok=True)
    data = out / "prompts.jsonl"
    prompts = [s.turns[0] for s in load_dataset("humaneval", max_samples=args.requests, seed=args.seed)]
    data.write_text("".join(json.dumps({"prompt": p, "output_tokens_count": args.max_tokens}) + "\n" for p in prompts))
    rows = []
    for batch in [int(b) for b in args.max_batch.split(",")]:
        proc, url, notes = start_server(args.recipe, args.cache_dir, args.sets, batch, args.mode)
        try:
            for clients in [int(c) for c in args.clients.split(",")]:
                report = out / f"guidellm-batch{batch}-clients{clients}.json"
                spec = out / f"scenario-batch{batch}-clients{clients}.json"
                spec.write_text(json.dumps(scenario(url, recipe.name, data, tokenizer, clients, args.requests, report)))
                cmd = [str(guidellm), "run", "--scenario", str(spec), "--disable-console-interactive"]
                done = subprocess.run(cmd, capture_output=True, text=True)
                if done.returncode != 0:
                    raise SystemExit(f"guidellm exited {done.returncode}:\n{done.stderr[-3000:]}")
                row = {"max_batch": batch, "clients": clients, "mode": args.mode, **summary(report), "notes": notes}
                rows.append(row)
                print(json.dumps(row), flush=True)
        finally:
            proc.terminate()
            proc.wait(60)
    doc = {"recipe": args.recipe, "sets": args.sets, "mode": args.mode, "max_tokens": args.max_tokens, "rows": rows}
    (out / "summary.json").write_text(json.dumps(doc, indent=1))
    base = {r["clients"]: r["output_tok_s"] for r in rows if r["max_batch"] == 1}
    lines = [
        "| max batch | clients | output tok/s | vs one at a time | p50 / p99 ITL ms | p50 TTFT ms |",
        "|---|---|---|---|---|---|",
    ]
    for r in rows:
        ratio = r["output_tok_s"] / base[r["clients"]] if base.get(r["clients"]) and r["output_tok_s"] else None
        vs = "" if ratio is None else f"{ratio:.2f}x"
        lines.append(
            f"| {r['max_batch']} | {r['clients']} | {r['output_tok_s']:.1f} | {vs} "
            f"| {r['p50_itl_ms']:.1f} / {r['p99_itl_ms']:.1f} | {r['p50_ttft_ms']:.0f} |"
        )
    (out / "summary.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
