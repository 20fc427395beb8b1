"""The hostile cases of the hardening issue, before and after: each case's exit code (or HTTP status)
and first line, run against this checkout and, with --old REV, against an old revision side by side.

    .venv/bin/python benchmarks/hostile_cases.py [--old 1090b0b] [--new HEAD] [--only serve,bench,cache,cli]
        [--out FILE]

Everything runs the real `dflash` (`python -m dflash_cli` in the checkout under test) in subprocesses,
on the shipped demo pair and tiny random pairs, each revision with its own cache. Both revisions are
checked out with `git worktree` in a temporary folder (removed after), so editing this checkout while
it runs changes nothing; `--new .` runs this working tree as it is instead.
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
GROUPS = ("serve", "bench", "cache", "damage", "images", "drafts", "cli")


class Source:
    """One checkout under test: runs its `dflash` with this venv, in its own scratch folder."""

    def __init__(self, src: Path, scratch: Path) -> None:
        self.src, self.scratch = src, scratch
        self.cache = scratch / "cache"
        self.env = {**os.environ, "PYTHONPATH": str(src), "PYTHONUNBUFFERED": "1", "NO_COLOR": "1", "COLUMNS": "200"}

    def argv(self, *args: str) -> list[str]:
        return [sys.executable, "-m", "dflash_cli", *args]

    def run(self, *args: str, input: bytes = b"", closed_stdin: bool = False, timeout: float = 600) -> str:
        """`dflash ARGS --cache-dir CACHE`; `closed_stdin` runs it with file descriptor 0 closed (`<&-`)."""
        code, output = self.run_raw(*args, input=input, closed_stdin=closed_stdin, timeout=timeout)
        return f"still running after {timeout:.0f} s (killed)" if code is None else outcome(code, output)

    def run_raw(self, *args: str, input: bytes = b"", closed_stdin: bool = False, timeout: float = 600):
        argv = self.argv(*args, "--cache-dir", str(self.cache))
        closing = {"preexec_fn": lambda: os.close(0), "stdin": None} if closed_stdin else {"input": input}
        try:
            proc = subprocess.run(argv, capture_output=True, env=self.env, cwd=self.src, timeout=timeout, **closing)
        except subprocess.TimeoutExpired:
            return None, b""
        return proc.returncode, proc.stdout + proc.stderr

    def popen(self, *args: str, **kw: Any) -> subprocess.Popen:
        return subprocess.Popen(self.argv(*args, "--cache-dir", str(self.cache)), env=self.env, cwd=self.src, **kw)


def outcome(code: int, output: bytes) -> str:
    """`exit N · the first line that says what happened` (a traceback is named as such)."""
    text = output.decode("utf-8", "replace")
    lines = [ln.strip(" │╭╰─╮╯") for ln in text.splitlines()]
    lines = [ln for ln in lines if ln and ln != "Error"]  # a usage-error panel's title: its message follows
    said = next((ln for ln in lines if ln.startswith("error:")), None)
    usage = ("No such option", "Invalid value", "Missing", "Got unexpected")
    said = said or next((ln for ln in lines if ln.startswith(usage)), None) or (lines or [""])[0]
    if "Traceback (most recent call last)" in text:
        last = [ln for ln in lines if re.match(r"^[A-Za-z_][\w.]*(Error|Exception|Line|Read)\b", ln)]
        said = "TRACEBACK " + (last[-1] if last else said)
    return f"exit {code} · {said[:160]}"


# --- HTTP helpers -------------------------------------------------------------------------------
def post(url: str, path: str, body: bytes, timeout: float = 120) -> tuple[int | str, str, float]:
    parts = urlsplit(url)
    start = time.monotonic()
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=timeout)
    try:
        conn.request("POST", path, body, {"content-type": "application/json"})
        res = conn.getresponse()
        data = res.read().decode("utf-8", "replace")
        kind = res.getheader("content-type", "")
        first = data.splitlines()[0][:120] if data else ""
        return res.status, f"{kind.split(';')[0]}: {first}", time.monotonic() - start
    except (OSError, http.client.HTTPException) as exc:
        return type(exc).__name__, "", time.monotonic() - start
    finally:
        conn.close()


def health_latency(url: str, stop: threading.Event, worst: list[float]) -> None:
    """Poll /health until `stop`; keep the slowest answer's seconds in worst[0]."""
    while not stop.is_set():
        parts = urlsplit(url)
        start = time.monotonic()
        try:
            conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=120)
            conn.request("GET", "/health")
            conn.getresponse().read()
            conn.close()
        except OSError:
            pass
        worst[0] = max(worst[0], time.monotonic() - start)
        time.sleep(0.05)


@contextlib.contextmanager
def server(source: Source, recipe: str, *extra: str) -> Iterator[tuple[str, subprocess.Popen]]:
    proc = source.popen("serve", "-r", recipe, "--port", "0", *extra, stderr=subprocess.PIPE, stdout=subprocess.PIPE)
    line = ""
    while "serving" not in line:
        line = proc.stderr.readline().decode()
        if not line and proc.poll() is not None:
            raise SystemExit(f"the server exited: {proc.stderr.read().decode()[-400:]}")
    proc.log = []  # what the server logs from here on, line by line

    def keep() -> None:
        for raw in proc.stderr:
            proc.log.append(raw.decode("utf-8", "replace"))

    threading.Thread(target=keep, daemon=True).start()
    url = re.search(r"http://\S+/v1", line).group(0).removesuffix("/v1")
    try:
        yield url, proc
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()


def metric(url: str, name: str, **labels: str) -> float:
    parts = urlsplit(url)
    conn = http.client.HTTPConnection(parts.hostname, parts.port, timeout=30)
    conn.request("GET", "/metrics")
    text = conn.getresponse().read().decode()
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    return float("nan")


# --- serve cases --------------------------------------------------------------------------------
def serve_cases(source: Source) -> dict[str, str]:
    out: dict[str, str] = {}
    demo = "demo"
    source.run("build", "-r", demo)
    with server(source, demo) as (url, proc):
        # A non-streamed request whose client leaves after 0.3 s, then a short one.
        parts = urlsplit(url)
        body = json.dumps({"prompt": "def fibonacci(n):", "max_tokens": 990}).encode()
        sock = socket.create_connection((parts.hostname, parts.port))
        sock.sendall(f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
        time.sleep(0.3)
        sock.close()
        left = time.monotonic()
        counted = {}
        while not any(counted.values()) and time.monotonic() - left < 60:
            time.sleep(0.05)
            counted = {r: metric(url, "vllm:request_success_total", finished_reason=r) for r in ("abort", "length")}
            counted = {r: 0.0 if n != n else n for r, n in counted.items()}  # NaN: no such counter
        freed = time.monotonic() - left
        status, _, seconds = post(url, "/v1/completions", json.dumps({"prompt": "x =", "max_tokens": 4}).encode())
        how = ", ".join(f"{r} {n:.0f}" for r, n in counted.items())
        out["serve: non-streamed client disconnects"] = (
            f"counted {how}; engine free {freed:.1f} s after the client left; next request HTTP {status}"
        )

        for _ in range(3):  # declares 1000 bytes, sends 20 and leaves
            with socket.create_connection((parts.hostname, parts.port)) as cut:
                cut.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\n" + b"{" * 20)
            time.sleep(0.3)
        status, _, _ = post(url, "/v1/completions", json.dumps({"prompt": "x =", "max_tokens": 4}).encode())
        tracebacks = sum("Traceback (most recent call last)" in ln for ln in proc.log)
        out["serve: 3 request bodies cut short by their clients"] = (
            f"{tracebacks} tracebacks in the server log; next request HTTP {status}"
        )

        big = "x" * (10 << 20)
        for name, path, doc in (
            ("serve: 10 MB prompt", "/v1/completions", {"prompt": big}),
            ("serve: 10 MB chat request", "/v1/chat/completions", {"messages": [{"role": "user", "content": big}]}),
        ):
            stop, worst = threading.Event(), [0.0]
            watcher = threading.Thread(target=health_latency, args=(url, stop, worst))
            watcher.start()
            status, first, seconds = post(url, path, json.dumps(doc).encode())
            stop.set()
            watcher.join()
            out[name] = f"HTTP {status} after {seconds:.1f} s; /health's slowest answer {worst[0]:.2f} s · {first}"
        for name, raw in (
            ("serve: prompt with a lone surrogate", b'{"prompt": "abc\\ud800def"}'),
            ("serve: 100k-deep nested JSON array", b"[" * 100_000 + b"]" * 100_000),
        ):
            status, first, _ = post(url, "/v1/completions", raw)
            out[name] = f"HTTP {status} · {first}"

    # A stop while one request decodes and one waits: --graceful-timeout 0 cuts both at once.
    with server(source, demo, "--graceful-timeout", "0") as (url, proc):
        replies: dict = {}

        def whole() -> None:
            doc = {"prompt": "def fibonacci(n):", "max_tokens": 990}
            replies["whole"] = post(url, "/v1/completions", json.dumps(doc).encode())

        def stream() -> None:
            doc = {"prompt": "class Stack:", "max_tokens": 990, "stream": True}
            conn = http.client.HTTPConnection(*urlsplit(url).netloc.split(":"), timeout=120)
            conn.request("POST", "/v1/completions", json.dumps(doc).encode(), {"content-type": "application/json"})
            res = conn.getresponse()
            events = []
            try:
                for raw in res:
                    if raw.startswith(b"data: "):
                        events.append(raw[6:].strip().decode())
            except (OSError, http.client.HTTPException) as exc:
                events.append(f"<{type(exc).__name__}>")
            replies["stream"] = (res.status, events)

        threads = [threading.Thread(target=stream), threading.Thread(target=whole)]
        for t in threads:
            t.start()
            time.sleep(0.3)
        proc.send_signal(signal.SIGTERM)
        for t in threads:
            t.join(60)
        status, first, _ = replies.get("whole", ("none", "", 0))
        out["serve: request cut by --graceful-timeout (not streamed)"] = f"HTTP {status} · {first}"
        status, events = replies.get("stream", ("none", []))
        last = events[-2:] if events else []
        reason = None
        with contextlib.suppress(Exception):
            reason = json.loads(last[0])["choices"][0]["finish_reason"]
        out["serve: stream cut by --graceful-timeout"] = (
            f"HTTP {status}; ends with {'[DONE]' if events and events[-1] == '[DONE]' else repr(events[-1:])}"
            f" after finish_reason {reason!r}"
        )
    return out


# --- bench --endpoint cases ----------------------------------------------------------------------
ENDPOINT_KINDS = (
    "garbage_status",
    "bad_json",
    "choices_dict",
    "choices_str",
    "not_streamed",
    "cut_short",
    "cut_short_chunked",
    "no_done",
    "no_usage",
    "silent",
    "stalls",
    "keepalive",
    "long_line",
    "huge_usage",
    "negative_usage",
    "fractional_usage",
    "nan_metrics",
    "negative_metrics",
    "backwards_metrics",
)


def bench_cases(source: Source) -> dict[str, str]:
    from tests.fake_endpoints import start

    data = source.scratch / "prompts.jsonl"
    data.write_text('{"prompt": "hi there"}\n{"prompt": "second one"}\n')
    out = {}
    for kind in ENDPOINT_KINDS:
        url, stop = start(kind)
        try:
            args = ["bench", "--endpoint", url, "--dataset", str(data), "--max-new-tokens", "8"]
            code, output = source.run_raw(*args, "--timeout", "2", timeout=120)
            said = outcome(code, output) if code is not None else "still running after 120 s (killed)"
            if "exit 2" in said:  # before --timeout: the old default waits 600 s
                said = source.run(*args, timeout=20) + " (no --timeout: the default wait was 600 s)"
            told = [ln.strip() for ln in output.decode("utf-8", "replace").splitlines() if "endpoint acceptance" in ln]
            if code == 0 and told:  # a run that ends well but could not measure acceptance says so below its table
                said += f" · {told[0][:140]}"
        finally:
            stop()
        out[f"bench --endpoint: {kind.replace('_', ' ')}"] = said
    return out


# --- cache cases --------------------------------------------------------------------------------
def _race(source: Source, when: str, action: Callable[[Path], str], tag: str) -> str:
    """Build the demo into a fresh cache; when `when`'s first progress line appears, run `action`."""
    cache = source.scratch / f"race-{when}-{tag}"
    argv = [sys.executable, "-m", "dflash_cli", "build", "-r", "demo", "--cache-dir", str(cache)]
    build = subprocess.Popen(argv, env=source.env, cwd=source.src, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    err = b""
    while build.poll() is None:
        line = build.stderr.readline()
        err += line
        if line.decode().lstrip().startswith(f"{when}:"):
            break
    did = action(cache)
    rest_out, rest_err = build.communicate(timeout=600)
    shutil.rmtree(cache, ignore_errors=True)
    return f"build {outcome(build.returncode, err + rest_err)}; {did}"


def _clean(source: Source, *flags: str) -> Callable[[Path], str]:
    def act(cache: Path) -> str:
        argv = [sys.executable, "-m", "dflash_cli", "cache", "clean", *flags, "--cache-dir", str(cache)]
        proc = subprocess.run(argv, env=source.env, cwd=source.src, capture_output=True, text=True)
        said = " / ".join(ln.strip() for ln in proc.stderr.splitlines() if ln.strip())
        return f"clean said: {said[:150]}"

    return act


def _remove(relative: str) -> Callable[[Path], str]:
    def act(cache: Path) -> str:
        shutil.rmtree(cache / relative, ignore_errors=True)
        return f"removed {relative} by hand"

    return act


def damage_cases(source: Source) -> dict[str, str]:
    from tests.fixtures.damage import rot_in_place

    out = {}
    int4 = ("-r", "demo", "--set", "compile.ort.precision=int4")
    run = source.argv("run", *int4, "-p", "def fibonacci(n):", "--max-new-tokens", "16", "--json")
    run += ["--cache-dir", str(source.cache)]

    def text() -> tuple[int, str, str | None]:
        proc = subprocess.run(run, env=source.env, cwd=source.src, capture_output=True)
        said = outcome(proc.returncode, proc.stdout + proc.stderr)
        return proc.returncode, said, json.loads(proc.stdout)["text"] if proc.returncode == 0 else None

    source.run("build", *int4)
    for name, every in (("every 7th byte", 7), ("one byte", 0)):
        source.run("build", *int4, "--rebuild", "compile")  # compile writes the .q.data files itself
        (data,) = (source.cache / "artifacts" / "compile").glob("*/target.onnx.q.data")
        _, _, expected = text()
        rot_in_place(data, every)
        code, said, got = text()
        if code == 0:
            said += " · text " + ("unchanged" if got == expected else f"changed: {got!r}"[:80])
        out[f"int4 run after {name} of target.onnx.q.data flipped in place (mtime kept)"] = said
    source.run("build", *int4, "--rebuild", "compile")
    return out


def cache_cases(source: Source) -> dict[str, str]:
    out = {}
    scratch = source.scratch / "locks-cache"
    argv = ("-r", "demo", "--cache-dir", str(scratch))
    for args in (("build", *argv), ("run", *argv, "-p", "x =", "--max-new-tokens", "4")):
        subprocess.run(source.argv(*args), env=source.env, cwd=source.src, capture_output=True)
    before = len(list((scratch / "locks").iterdir()))
    subprocess.run(source.argv("cache", "clean", "--yes", "--cache-dir", str(scratch)), env=source.env, cwd=source.src)
    left = sorted(p.name for p in (scratch / "locks").iterdir())
    out["cache clean --yes after a build and a run: lock files left"] = f"{len(left)} of {before} left"
    shutil.rmtree(scratch, ignore_errors=True)
    for when in ("inject", "export", "compile"):
        out[f"cache clean --yes while the build runs {when}"] = _race(source, when, _clean(source, "--yes"), "yes")
    out["cache clean --older-than 0s while the build runs export"] = _race(
        source, "export", _clean(source, "--older-than", "0s"), "age"
    )
    out["rm -rf the inject artifacts while the build runs export"] = _race(
        source, "export", _remove("artifacts/inject"), "rm"
    )
    return out


# --- image cases --------------------------------------------------------------------------------
def _chat_with_image(url: str, image_url: str) -> str:
    content = [{"type": "image_url", "image_url": {"url": image_url}}, {"type": "text", "text": "What is it?"}]
    doc = {"messages": [{"role": "user", "content": content}], "max_tokens": 4}
    status, first, _ = post(url, "/v1/chat/completions", json.dumps(doc).encode(), timeout=30)
    return f"HTTP {status} · {first}"


def image_cases(source: Source) -> dict[str, str]:
    import base64
    import io

    from PIL import Image

    from tests.fixtures.tiny_pairs import make_pair

    work = source.scratch / "images"
    media = work / "media"
    media.mkdir(parents=True, exist_ok=True)
    pair = make_pair(work / "pair", "qwen3_vl")
    recipe = str(pair.write_recipe(work / "recipe.yaml", serve={"allowed_local_media_path": str(media)}))
    source.run("build", "-r", recipe)
    Image.new("RGB", (4000, 16), "white").save(media / "wide.png")
    Image.new("RGB", (32, 32), "white").save(media / "ok.png")
    (media / "adir").mkdir(exist_ok=True)
    if not (media / "fifo").exists():
        os.mkfifo(media / "fifo")
    out = {}
    run = ("run", "-r", recipe, "-p", "What is it?", "--max-new-tokens", "4", "--image")
    for name, path in (
        ("aspect ratio 250 (4000x16)", media / "wide.png"),
        ("a directory", media / "adir"),
        ("a FIFO", media / "fifo"),
        ("/dev/zero", Path("/dev/zero")),
    ):
        out[f"run --image: {name}"] = source.run(*run, str(path), timeout=120)
    wide = io.BytesIO()
    Image.new("RGB", (4000, 16), "white").save(wide, "PNG")
    with server(source, recipe) as (url, proc):
        out["serve image_url: aspect ratio 250 (data URL)"] = _chat_with_image(
            url, "data:image/png;base64," + base64.b64encode(wide.getvalue()).decode()
        )
        out["serve image_url: file://evil.example/..."] = _chat_with_image(url, f"file://evil.example{media}/ok.png")
        out["serve image_url: file:// a directory"] = _chat_with_image(url, f"file://{media}/adir")
        out["serve image_url: file:// a FIFO"] = _chat_with_image(url, f"file://{media}/fifo")
        out["serve image_url: data URL that is not an image"] = _chat_with_image(
            url, "data:image/png;base64," + base64.b64encode(b"not a picture at all").decode()
        )
        out["serve image_url: file:// a real image (control)"] = _chat_with_image(url, f"file://{media}/ok.png")
        tracebacks = sum("Traceback (most recent call last)" in ln for ln in proc.log)
        out["serve image cases: tracebacks in the server log"] = str(tracebacks)
    return out


# --- draft config cases ---------------------------------------------------------------------------
def draft_cases(source: Source) -> dict[str, str]:
    from tests.fixtures.tiny_dflash2 import make_dflash2_pair
    from tests.fixtures.tiny_pairs import make_pair
    from tests.test_speculators_format import as_speculators

    work = source.scratch / "drafts"
    out = {}
    zlab = make_pair(work / "zlab", "qwen3")
    config = zlab.draft_dir / "config.json"
    doc = json.loads(config.read_text())
    doc["dflash_config"]["use_target_norm"] = True
    config.write_text(json.dumps(doc))
    recipe = zlab.write_recipe(work / "zlab.yaml")
    out["z-lab draft with dflash_config.use_target_norm true"] = source.run(
        "build", "-r", str(recipe), "--upto", "convert"
    )
    v2 = make_dflash2_pair(work / "v2", "qwen3")
    spec = as_speculators(v2.draft_dir, work / "v2-speculators", selector_temperature=0.7)
    recipe = v2.write_recipe(work / "v2.yaml", draft={"path": str(spec)})
    out["speculators DFlash2 draft with selector_temperature 0.7"] = source.run(
        "build", "-r", str(recipe), "--upto", "convert"
    )
    return out


# --- CLI cases ----------------------------------------------------------------------------------
def cli_cases(source: Source) -> dict[str, str]:
    from tests.fixtures.tiny_pairs import write_dflash_draft, write_qwen3_target, write_recipe

    models, work = REPO / "models", source.scratch / "cli"
    work.mkdir(parents=True, exist_ok=True)
    source.run("build", "-r", "demo")
    out = {
        "run -p - with stdin closed": source.run("run", "-r", "demo", "-p", "-", closed_stdin=True),
        "run -p - with an empty stdin": source.run("run", "-r", "demo", "-p", "-"),
        "build demo --recipe qwen3-4b": source.run("build", "demo", "--recipe", "qwen3-4b", "--upto", "convert"),
        "run --mode hybrid --no-draft": source.run(
            "run", "-r", "demo", "-p", "def f(x):", "--max-new-tokens", "4", "--mode", "hybrid", "--no-draft"
        ),
    }
    bogus = work / "bogus.json"
    bogus.write_text('{"schema_version": 2}\n')
    out["bench compare of two non-results"] = source.run("bench", "compare", str(bogus), str(bogus))
    out["target and draft paths swapped"] = source.run(
        "build",
        "-r",
        "demo",
        "--set",
        f"target.path={models / 'demo-draft'}",
        "--set",
        f"draft.path={models / 'demo-target'}",
        "--upto",
        "convert",
    )
    small = work / "vocab-4000"
    shutil.copytree(models / "demo-target", small, dirs_exist_ok=True)
    config = small / "config.json"
    config.write_text(config.read_text().replace('"vocab_size": 4096', '"vocab_size": 4000'))
    out["config vocab_size 4000 < 4096 embedding rows"] = source.run(
        "build", "-r", "demo", "--set", f"target.path={small}", "--upto", "export"
    )
    target = write_qwen3_target(work / "hd24-target", layers=2, heads=4, kv_heads=2, head_dim=24)
    recipe = write_recipe(
        work / "hd24.yaml", target, write_dflash_draft(work / "hd24-draft", target, layers=1), "qwen3"
    )
    code, output = source.run_raw("build", "-r", str(recipe))
    notes = [ln.strip() for ln in output.decode("utf-8", "replace").splitlines() if "unfused" in ln]
    said = outcome(code, output) if code is not None else "killed"
    out["target with head_dim 24 (GroupQueryAttention rewrite on)"] = said + (f" · {notes[0]}" if notes else "")
    return out


# --- the table ----------------------------------------------------------------------------------
RUNNERS: dict[str, Callable[[Source], dict[str, str]]] = {
    "serve": serve_cases,
    "bench": bench_cases,
    "cache": cache_cases,
    "damage": damage_cases,
    "images": image_cases,
    "drafts": draft_cases,
    "cli": cli_cases,
}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--old", default=None, help="a git revision to run the same cases on (the 'before')")
    ap.add_argument("--new", default="HEAD", help="the revision for 'after' ('.': this working tree)")
    ap.add_argument("--only", default=",".join(GROUPS), help=f"comma-separated groups of {GROUPS}")
    ap.add_argument("--out", type=Path, default=None, help="also write the Markdown table here")
    args = ap.parse_args()
    groups = [g for g in args.only.split(",") if g]
    scratch = Path(tempfile.mkdtemp(prefix="dflash-hostile-"))
    trees: list[Path] = []

    def checkout(rev: str, name: str) -> Path:
        tree = scratch / name
        git = ["git", "-C", str(REPO), "worktree", "add", "--detach", str(tree), rev]
        subprocess.run(git, check=True, capture_output=True)
        trees.append(tree)
        return tree

    new = REPO if args.new == "." else checkout(args.new, "new-src")
    sources = {"after": Source(new, scratch / "after")}
    if args.old:
        sources = {"before": Source(checkout(args.old, "old-src"), scratch / "before"), **sources}
    results: dict[str, dict[str, str]] = {}
    try:
        for label, source in sources.items():
            source.scratch.mkdir(parents=True, exist_ok=True)
            for group in groups:
                print(f"[{label}] {group} ...", file=sys.stderr, flush=True)
                for case, said in RUNNERS[group](source).items():
                    results.setdefault(case, {})[label] = said
    finally:
        for tree in trees:
            subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(tree)])
        shutil.rmtree(scratch, ignore_errors=True)
    labels = list(sources)
    lines = ["| case | " + " | ".join(labels) + " |", "| --- |" + " --- |" * len(labels)]
    for case, by in results.items():
        cells = [by.get(label, "").replace("|", "/") for label in labels]
        lines.append(f"| {case} | " + " | ".join(cells) + " |")
    table = "\n".join(lines)
    print(table)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(table + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
