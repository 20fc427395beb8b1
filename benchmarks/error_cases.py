"""Run the user mistakes and faults of the cache/UX issue against a tiny pair; print a table of exit codes.

    .venv/bin/python benchmarks/error_cases.py [--out benchmarks/results/error-cases.md]

Each case runs the real `dflash` command in a subprocess (no terminal, as in CI) and records the exit
code and the `error:` / `hint:` lines (or the usage-error line).
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
DFLASH = str(Path(sys.executable).with_name("dflash"))


def run(args: list, stdin: bytes | None = None, env: dict | None = None) -> tuple[int, str]:
    proc = subprocess.run([DFLASH, *args], input=stdin or b"", capture_output=True, env=env)
    err = proc.stderr.decode("utf-8", "replace").splitlines()
    lines = [ln for ln in err if ln.startswith(("error:", "hint:", "Error", "Invalid value", "│ Invalid"))]
    if not lines:
        lines = [ln.strip(" │╭╰─") for ln in err if "Invalid" in ln or "unknown" in ln][:2] or err[-2:]
    if "Traceback" in proc.stderr.decode("utf-8", "replace"):
        lines = ["TRACEBACK"] + lines
    return proc.returncode, " / ".join(x.strip() for x in lines)


def main() -> None:
    from tests.fixtures.tiny_pairs import make_pair

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()

    root = Path(tempfile.mkdtemp(prefix="dflash-errors-"))
    pair = make_pair(root / "pair", "qwen3")
    recipe = str(pair.write_recipe(root / "recipe.yaml"))
    cache = str(root / "cache")
    base = ["-r", recipe, "--cache-dir", cache]
    assert run(["build", *base])[0] == 0
    rows = []

    def case(name: str, argv: list, stdin: bytes | None = None) -> None:
        code, msg = run(argv, stdin)
        rows.append((name, code, msg))

    case("run --max-new-tokens 0", ["run", *base, "-p", "x", "--max-new-tokens", "0"])
    case("run --max-new-tokens -1", ["run", *base, "-p", "x", "--max-new-tokens", "-1"])
    case("run --temperature -1", ["run", *base, "-p", "x", "--temperature", "-1"])
    case("run --top-p 2", ["run", *base, "-p", "x", "--top-p", "2"])
    case("run --top-k -3", ["run", *base, "-p", "x", "--top-k", "-3"])
    case("run with a non-UTF-8 prompt (argv bytes)", ["run", *base, "-p", b"def f(\xff):"])
    case("run -p - with non-UTF-8 stdin", ["run", *base, "-p", "-"], stdin=b"x = '\xfe'")
    case("bench --results DIR", ["bench", *base, "--dataset", "humaneval", "--results", str(root)])
    (root / "afile").write_text("x")
    under_file = f"{root}/afile/r.jsonl"
    case("bench --results under a file", ["bench", *base, "--dataset", "humaneval", "--results", under_file])
    case("bench --block-sizes 4,,8", ["bench", *base, "--dataset", "humaneval", "--block-sizes", "4,,8"])
    case("build -r qwen3-8 (typo)", ["build", "-r", "qwen3-8", "--cache-dir", cache])
    case("build --set export.ctxlen=1 (typo)", ["build", *base, "--set", "export.ctxlen=1"])
    case("build --upto exprot (typo)", ["build", *base, "--upto", "exprot"])
    case("cache clean (everything, no terminal, no --yes)", ["cache", "clean", "--cache-dir", cache])
    case("compile --backend qaic without the SDK", ["compile", *base, "--backend", "qaic"])

    notok = root / "notok"
    shutil.copytree(pair.target_dir, notok / "target")
    shutil.copytree(pair.draft_dir, notok / "draft")
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (notok / "target" / f).unlink()
    bad = pair.write_recipe(root / "notok.yaml")
    text = Path(bad).read_text().replace(str(pair.target_dir), str(notok / "target"))
    Path(bad).write_text(text)
    case("build a target without tokenizer files", ["build", "-r", str(bad), "--cache-dir", cache])

    (graph,) = (Path(cache) / "artifacts" / "export").glob("*/target.onnx")
    data = bytearray(graph.read_bytes())
    data[len(data) // 3] ^= 0x01
    time.sleep(0.01)
    graph.write_bytes(bytes(data))
    case("run after one flipped byte in the cached target.onnx", ["run", *base, "-p", "x", "--max-new-tokens", "3"])
    case("build --rebuild compile after that flip", ["build", *base, "--rebuild", "compile"])
    case("build --rebuild export (the fix)", ["build", *base, "--rebuild", "export"])
    case("run after the fix", ["run", *base, "-p", "x", "--max-new-tokens", "3"])

    lines = ["| case | exit | message |", "| --- | --- | --- |"]
    lines += [f"| {n} | {c} | {m.replace('|', '/')} |" for n, c, m in rows]
    table = "\n".join(lines)
    print(table)
    if args.out:
        args.out.write_text(table + "\n")
    shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
