"""llama.cpp as a peer through its own `llama-server` binary: plain decoding, or its DFlash (`--spec-type
draft-dflash`), fed token ids over HTTP one request at a time.

The binaries are built from the llama.cpp tree vendored in the llama-cpp-python sdist
(`PEERS_LLAMA_CPP_BIN=1 bash benchmarks/peers_setup.sh`); the GGUF files come from that tree's own converter
(`convert_hf_to_gguf.py`; a DFlash draft with `--target-model-dir`).
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

SHIM = """import sys, runpy
sys.path[:0] = [sys.argv[1], sys.argv[1] + '/gguf-py']
from conversion import base
known = base.TextModel.get_vocab_base_pre
def pre(self, tok):  # a tokenizer llama.cpp does not know by hash: byte-level BPE, as Qwen2's
    try:
        return known(self, tok)
    except NotImplementedError:
        return 'qwen2'
base.TextModel.get_vocab_base_pre = pre
import gguf
add = gguf.SpecialVocab.add_to_gguf
def add_to_gguf(self, gw, quiet=False):  # a vocabulary without merges (random pairs'): llama.cpp insists on the key
    self.merges = self.merges or ['! "']
    return add(self, gw, quiet)
gguf.SpecialVocab.add_to_gguf = add_to_gguf
sys.argv = [sys.argv[1] + '/convert_hf_to_gguf.py'] + sys.argv[2:]
runpy.run_path(sys.argv[0], run_name='__main__')
"""


def gguf(src: Path, checkpoint: Path, out: Path, target: Path | None = None) -> Path:
    """`checkpoint` as f32 GGUF at `out` (made once); a DFlash draft takes its vocabulary from `target`."""
    if not out.is_file():
        part = out.with_suffix(".part")
        cmd = [sys.executable, "-c", SHIM, str(src), str(checkpoint), "--outtype", "f32", "--outfile", str(part)]
        cmd += ["--target-model-dir", str(target)] if target else []
        subprocess.run(cmd, check=True)
        part.rename(out)
    return out


def quantised(bin_dir: Path, f32: Path, quant: str) -> Path:
    """`f32` quantised by llama.cpp's own llama-quantize (q4_0, q8_0, ...), made once; f32 itself for "f32"."""
    if quant == "f32":
        return f32
    out = f32.with_name(f32.name.replace("-f32", f"-{quant}"))
    if not out.is_file():
        part = out.with_suffix(".part")
        subprocess.run([str(bin_dir / "llama-quantize"), str(f32), str(part), quant.upper(), "2"], check=True)
        part.rename(out)
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LlamaServer:
    """One llama-server process; `failure` holds why it could not serve (its log's error line), else None."""

    def __init__(
        self, bin_dir: Path, model: Path, log: Path, draft: Path | None = None, block: int = 16, extra: tuple = ()
    ) -> None:
        self.port, self.log, self.failure = _free_port(), log, None
        cmd = [str(bin_dir / "llama-server"), "-m", str(model), "-c", "4096", "-t", "2", "-tb", "2", "-np", "1"]
        cmd += ["--port", str(self.port), "--no-warmup", *extra]
        if draft:
            cmd += ["-md", str(draft), "--spec-type", "draft-dflash", "--spec-draft-n-max", str(block - 1), "-td", "2"]
        self.proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT)
        for _ in range(600):
            if self.proc.poll() is not None:
                self.failure = self._why()
                return
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=1) as r:
                    if r.status == 200:
                        return
            except OSError:
                time.sleep(0.1)
        self.failure = "did not start in 60 s"

    def run(self, ids: list[int], new: int, ignore_eos: bool = False) -> dict:
        """Greedy from `ids`, stopping at end of text or `new` tokens: tokens, ttft_s, decode_s (llama.cpp's own
        timings: prompt processing, then generation from the first token), draft counts where it speculates."""
        if self.failure:
            raise RuntimeError(self.failure)
        body = {"prompt": ids, "n_predict": new, "temperature": 0, "top_k": 1, "cache_prompt": False}
        body |= {"return_tokens": True, "ignore_eos": ignore_eos}
        req = urllib.request.Request(
            f"http://127.0.0.1:{self.port}/completion", json.dumps(body).encode(), {"Content-Type": "application/json"}
        )
        try:
            with urllib.request.urlopen(req, timeout=600) as r:
                doc = json.loads(r.read())
        except OSError as exc:
            time.sleep(0.5)
            self.failure = self._why() or f"request failed: {exc}"
            raise RuntimeError(self.failure) from None
        t = doc["timings"]
        out = {"tokens": doc["tokens"], "ttft_s": t["prompt_ms"] / 1000, "decode_s": t["predicted_ms"] / 1000}
        if "draft_n" in t:
            out |= {"draft_n": t["draft_n"], "draft_n_accepted": t["draft_n_accepted"]}
        return out

    def peak_rss_bytes(self) -> int | None:
        try:
            for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
        except OSError:
            return None
        return None

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(10)

    def _why(self) -> str | None:
        lines = self.log.read_text(errors="replace").splitlines() if self.log.is_file() else []
        for line in lines:
            if "GGML_ASSERT" in line or "error" in line.lower():
                return line.split("llama.cpp/", 1)[-1].strip()
        return f"exited with {self.proc.poll()}" if self.proc.poll() is not None else None


def version(bin_dir: Path) -> str:
    out = subprocess.run([str(bin_dir / "llama-server"), "--version"], capture_output=True, text=True)
    return " ".join((out.stdout + out.stderr).split())[:120]
