"""Plain greedy decode speed, dflash vs ONNX Runtime GenAI (and llama.cpp), interleaved on one checkpoint.

Runs in a benchmark venv that has both dflash and onnxruntime-genai (never a dflash dependency):

    bash benchmarks/peers_setup.sh                       # creates .bench-venv (dflash -e + onnxruntime-genai)
    .bench-venv/bin/python benchmarks/peers_decode.py --pair /work/pairs/qwen3-0.6b --work /work/peers

For each precision (fp32, int4) it builds the target once with GenAI's model builder and once with
`dflash build` (compile.ort.precision), then, REPS times in turn, decodes NEW tokens greedily from the
same prompt token ids (held-out standard-library text) with each engine: dflash plain with
allow_spinning off (the default, right for DFlash's two sessions) and on (plain's best), and GenAI.
Decode tok/s excludes the prompt and the first token. Reported: medians and ratios to GenAI per
precision, and the dflash-vs-GenAI token agreement (random weights: both are greedy on the same
weights; fp32 should agree, int4 quantisers differ).

With --llama-cpp SRC (a llama.cpp source tree, e.g. the `vendor/llama.cpp` of the llama-cpp-python
sdist: `pip download llama-cpp-python --no-binary :all:`), llama.cpp joins the rounds too (installed
by `PEERS_LLAMA_CPP=1 bash benchmarks/peers_setup.sh`): the target converted to GGUF f32 by the tree's
convert_hf_to_gguf.py and quantised to --llama-quants (q8_0, q4_0, q4_k_m) through llama_cpp's quantise call,
run with 2 threads (this machine's cores) through llama-cpp-python, same prompt ids, greedy.

With --openvino-genai PYTHON (the python of the venv `PEERS_OPENVINO_GENAI=1 bash benchmarks/peers_setup.sh`
makes), openvino-genai joins too: the target converted by optimum-intel's exporter at each precision
(fp32; int4 as NNCF compresses it, group size --ov-group-size, every layer), decoded through
LLMPipeline by `ov_genai_worker.py`, one worker process per model, fed the same prompt ids each round.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def genai_model(pair: Path, work: Path, precision: str) -> Path:
    out = work / f"genai-{precision}"
    if not (out / "genai_config.json").is_file():
        cmd = [sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(pair / "target"), "-o", str(out)]
        cmd += ["-p", precision, "-e", "cpu", "-c", str(work / "genai-cache")]
        subprocess.run(cmd, check=True)
    return out


def dflash_engine(pair: Path, work: Path, precision: str, spinning: bool, block: int, built: str = ""):
    """dflash's engine for the pair, built in `work` at ctx_len 1024, or `built` ('RECIPE:CACHE_DIR', a build
    made earlier, e.g. by scale_build.py: a real-size pair is not exported twice)."""
    from dflash_cli.cache.store import Cache
    from dflash_cli.decoding.engine import Engine
    from dflash_cli.recipe.schema import load_recipe
    from dflash_cli.stages.pipeline import build

    recipe, cache_dir = (Path(p) for p in built.split(":")) if built else (work / "recipe.yaml", work / "dflash-cache")
    if not built:
        family = json.loads((pair / "target" / "config.json").read_text())["model_type"]
        recipe.write_text(
            f"name: peers\nfamily: {family}\ntarget: {{path: {pair / 'target'}}}\n"
            f"draft: {{path: {pair / 'draft'}}}\nexport: {{ctx_len: 1024, prefill_seq_len: 128}}\n"
        )
    sets = [f"compile.ort.precision={precision}", f"compile.ort.allow_spinning={str(spinning).lower()}"]
    sets += [f"compile.ort.block_size={block}"] if precision != "fp32" else []
    r = load_recipe(str(recipe), sets)
    cache = Cache(cache_dir)
    build(r, cache)
    return Engine.load(r, cache)


def llama_model(pair: Path, work: Path, src: Path, quant: str, outtype: str = "f32", extra: tuple = ()) -> Path:
    """GGUF of the target: converted at `outtype` (f32; bf16 halves the disk a large shape needs) once, then
    quantised with llama.cpp's own quantiser."""
    f32 = work / f"llama-{outtype}.gguf"
    if quant != outtype and (work / f"llama-{quant}.gguf").is_file():
        return work / f"llama-{quant}.gguf"  # quantised earlier (the converted file may be gone)
    if not f32.is_file():
        # A random pair's tokenizer is not one convert_hf_to_gguf knows by hash; its pre-tokenizer is
        # Qwen2's (byte-level BPE), and the benchmark feeds token ids anyway, so the text side only
        # has to load.
        shim = (
            "import sys, runpy; sys.path[:0] = [sys.argv[1], sys.argv[1] + '/gguf-py']\n"
            "from conversion import base\n"
            "known = base.TextModel.get_vocab_base_pre\n"
            "def pre(self, tok):\n"
            "    try:\n        return known(self, tok)\n"
            "    except NotImplementedError:\n        return 'qwen2'\n"
            "base.TextModel.get_vocab_base_pre = pre\n"
            # A random pair's tokenizer has a vocabulary and no merges; llama.cpp insists on the key.
            "import gguf\n"
            "add = gguf.SpecialVocab.add_to_gguf\n"
            "def add_to_gguf(self, gw, quiet=False):\n"
            "    self.merges = self.merges or ['! \"']\n"
            "    return add(self, gw, quiet)\n"
            "gguf.SpecialVocab.add_to_gguf = add_to_gguf\n"
            "sys.argv = [sys.argv[1] + '/convert_hf_to_gguf.py'] + sys.argv[2:]\n"
            "runpy.run_path(sys.argv[0], run_name='__main__')\n"
        )
        cmd = [sys.executable, "-c", shim, str(src), str(pair / "target"), "--outtype", outtype, "--outfile", str(f32)]
        cmd += list(extra)  # e.g. --no-mtp: a random Qwen3.5 pair has no multi-token-prediction layers
        subprocess.run(cmd, check=True)
    if quant == outtype:
        return f32
    out = work / f"llama-{quant}.gguf"
    if not out.is_file():
        import llama_cpp

        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype = {
            "q8_0": llama_cpp.LLAMA_FTYPE_MOSTLY_Q8_0,
            "q4_0": llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_0,
            "q4_k_m": llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_K_M,
            "mxfp4_moe": llama_cpp.LLAMA_FTYPE_MOSTLY_MXFP4_MOE,  # gpt-oss as published: MXFP4 experts
        }[quant]
        params.nthread = 2
        params.allow_requantize = True  # gpt-oss's experts arrive as MXFP4 in the converted file
        part = out.with_suffix(".part")  # a killed or failed run leaves no file a rerun would take as done
        if llama_cpp.llama_model_quantize(str(f32).encode(), str(part).encode(), params) != 0:
            part.unlink(missing_ok=True)
            raise SystemExit(f"llama.cpp could not quantise {f32} to {quant}")
        part.rename(out)
    return out


def run_llama(llm, prompt: list[int], new: int) -> tuple[list[int], float, float]:
    tokens = []
    t0 = time.perf_counter()
    t1 = t0
    for tok in llm.generate(prompt, top_k=1, top_p=1.0, temp=0.0, repeat_penalty=1.0, reset=True):
        tokens.append(int(tok))
        if len(tokens) == 1:
            t1 = time.perf_counter()
        if len(tokens) == new:
            break
    t2 = time.perf_counter()
    return tokens, t1 - t0, t2 - t1


def ov_genai_model(python: str, checkpoint: Path, out: Path, precision: str, group: int = 32) -> Path:
    """The checkpoint as optimum-intel's exporter writes it for openvino-genai, at `out` (made once)."""
    if not (out / "openvino_model.xml").is_file():
        cli = str(Path(python).with_name("optimum-cli"))
        cmd = [cli, "export", "openvino", "--model", str(checkpoint), "--task", "text-generation-with-past"]
        cmd += ["--weight-format", precision]
        cmd += ["--group-size", str(group), "--ratio", "1.0"] if precision in ("int4", "int8") else []
        tmp = out.with_name(out.name + ".part")  # a killed conversion leaves nothing a rerun would take as done
        subprocess.run(cmd + [str(tmp)], check=True)
        tmp.rename(out)
    return out


class OvGenAIWorker:
    """An openvino-genai pipeline in its own venv's process (see ov_genai_worker.py)."""

    def __init__(self, python: str, model: Path, threads: int = 2, draft: Path | None = None, extra: tuple = ()):
        worker = str(Path(__file__).with_name("ov_genai_worker.py"))
        cmd = [python, worker, str(model), "--threads", str(threads)] + (["--draft", str(draft)] if draft else [])
        cmd += list(extra)
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        if not json.loads(self.proc.stdout.readline()).get("ready"):
            raise SystemExit(f"openvino-genai could not load {model}")

    def run(self, prompt: list[int], new: int, ignore_eos=True, assistant_tokens=0) -> tuple[list[int], float, float]:
        req = {"ids": prompt, "new": new, "ignore_eos": ignore_eos, "assistant_tokens": assistant_tokens}
        self.proc.stdin.write(json.dumps(req) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise SystemExit("the openvino-genai worker died (its error is above)")
        self.last = json.loads(line)
        return self.last["tokens"], self.last["ttft_s"], self.last["decode_s"]


def run_genai(model, prompt: list[int], new: int) -> tuple[list[int], float, float]:
    import onnxruntime_genai as og

    params = og.GeneratorParams(model)
    params.set_search_options(max_length=len(prompt) + new, do_sample=False)
    gen = og.Generator(model, params)
    t0 = time.perf_counter()
    gen.append_tokens(prompt)
    gen.generate_next_token()
    t1 = time.perf_counter()
    while not gen.is_done():
        gen.generate_next_token()
    t2 = time.perf_counter()
    tokens = list(gen.get_sequence(0))[len(prompt) :]
    return tokens, t1 - t0, t2 - t1


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pair", type=Path, required=True)
    ap.add_argument("--work", type=Path, required=True)
    ap.add_argument("--precisions", default="fp32,int4")
    ap.add_argument("--reps", type=int, default=4)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--prompt-tokens", type=int, default=100)
    ap.add_argument("--out", type=Path)
    ap.add_argument("--llama-cpp", type=Path, help="llama.cpp source tree (its converter); adds llama.cpp")
    ap.add_argument("--llama-quants", default="f32,q8_0,q4_0")
    ap.add_argument("--llama-outtype", default="f32", help="GGUF the converter writes first (f32, bf16)")
    ap.add_argument("--llama-convert-args", default="", help="more converter flags, e.g. --no-mtp")
    ap.add_argument(
        "--no-genai", action="store_true", help="leave GenAI out (its builder needs ~6x the weights in RAM)"
    )
    ap.add_argument("--openvino-genai", metavar="PYTHON", help="the openvino-genai venv's python; adds it")
    ap.add_argument("--ov-group-size", type=int, default=32, help="NNCF int4/int8 group size (q4_0's is 32)")
    ap.add_argument("--threads", type=int, default=2, help="llama.cpp/OpenVINO threads (ORT: its own default)")
    ap.add_argument("--dflash-blocks", default="32", help="int8/int4 block sizes, one dflash build each")
    ap.add_argument("--dflash-spinning", default="off,on", help="dflash plain rows: spinning off, on or both")
    ap.add_argument("--dflash-build", default="", metavar="RECIPE:CACHE_DIR", help="use this build, made earlier")
    ap.add_argument("--no-dflash", action="store_true", help="peers only (a shape whose two copies do not fit)")
    args = ap.parse_args()
    import dflash_cli.host.ort_threads as ort_threads

    # GenAI runs ONNX Runtime sessions in this process too, and a process-wide shared pool would be forced
    # on them; dflash's rows here are one target session each, spinning off / on, with pools of their own.
    ort_threads.SHARED_POOL_ALLOWED = False
    import onnxruntime_genai as og

    from dflash_cli.readiness.fp16_bands import corpus_tokens

    args.work.mkdir(parents=True, exist_ok=True)
    engines: dict[str, tuple[str, object]] = {}
    for precision in args.precisions.split(","):
        if not args.no_genai:
            engines[f"genai {precision}"] = ("genai", og.Model(str(genai_model(args.pair, args.work, precision))))
        for block in [] if args.no_dflash else args.dflash_blocks.split(",") if precision != "fp32" else ["-"]:
            for spin in args.dflash_spinning.split(","):
                blk = int(block) if block != "-" else 0
                e = dflash_engine(args.pair, args.work, precision, spin == "on", blk, args.dflash_build)
                label = f"dflash {precision}" + (f" block {block}" if block != "-" else "")
                engines[f"{label} plain, spinning {spin}"] = ("dflash", e)
    if args.llama_cpp:
        import llama_cpp

        for quant in args.llama_quants.split(","):
            extra = tuple(args.llama_convert_args.split())
            path = llama_model(args.pair, args.work, args.llama_cpp, quant, args.llama_outtype, extra)
            llm = llama_cpp.Llama(
                str(path), n_ctx=1024, n_threads=args.threads, n_threads_batch=args.threads, verbose=False
            )
            engines[f"llama.cpp {quant}"] = ("llama", llm)
    if args.openvino_genai:
        for precision in args.precisions.split(","):
            out = args.work / f"ov-genai-{precision}"
            path = ov_genai_model(args.openvino_genai, args.pair / "target", out, precision, args.ov_group_size)
            engines[f"openvino-genai {precision}"] = ("ovgenai", OvGenAIWorker(args.openvino_genai, path, args.threads))
    first = next((e for kind, e in engines.values() if kind == "dflash"), None)
    if first is None:  # --no-dflash: the target's own tokenizer, which is what dflash's engine loads
        from transformers import AutoTokenizer

        first = types.SimpleNamespace(tokenizer=AutoTokenizer.from_pretrained(args.pair / "target"))
    prompt = corpus_tokens(lambda text: list(first.tokenizer(text)["input_ids"]), args.prompt_tokens)
    rates: dict[str, list[float]] = {name: [] for name in engines}
    outputs: dict[str, list[int]] = {}
    for rep in range(args.reps + 1):  # the first round warms up and is not counted
        for name, (kind, e) in engines.items():
            if kind == "genai":
                tokens, _, decode_s = run_genai(e, prompt, args.new)
            elif kind == "llama":
                tokens, _, decode_s = run_llama(e, prompt, args.new)
            elif kind == "ovgenai":
                tokens, _, decode_s = e.run(prompt, args.new)
            else:
                g = e.generate(prompt, mode="plain", max_new_tokens=args.new)
                tokens, decode_s = g.tokens, g.decode_s
            outputs[name] = tokens
            if rep:
                rates[name].append((len(tokens) - 1) / decode_s)
        print(f"round {rep}/{args.reps} done", flush=True)
    doc = {
        "pair": str(args.pair),
        "prompt_tokens": len(prompt),
        "new_tokens": args.new,
        "reps": args.reps,
        "engines": {},
    }
    # The closest llama.cpp precisions to each of ours. Bits per weight: q4_0 4.5 (32-weight blocks, fp16
    # scales), Q4_K_M ~4.9 (q4_K super-blocks of 256, some tensors q6_K); MatMulNBits keeps fp32 scales, so
    # int4 is 5.0 at block 32, 4.5 at block 64, 4.25 at block 128.
    closest = {
        "fp32": ["llama.cpp f32", "openvino-genai fp32"],
        "int4": ["llama.cpp q4_0", "llama.cpp q4_k_m", "openvino-genai int4"],
        "int8": ["llama.cpp q8_0", "openvino-genai int8"],
    }
    for name, r in rates.items():
        precision = name.split()[1]
        entry = {"decode_tok_s_median": statistics.median(r), "range": [min(r), max(r)]}
        line = f"{name:40s} {statistics.median(r):7.2f} tok/s  [{min(r):.2f}, {max(r):.2f}]"
        if f"genai {precision}" in rates:
            ref = statistics.median(rates[f"genai {precision}"])
            same = sum(a == b for a, b in zip(outputs[name], outputs[f"genai {precision}"]))
            entry |= {"vs_genai": statistics.median(r) / ref, "tokens_equal_to_genai": f"{same}/{len(outputs[name])}"}
            line += f"  {statistics.median(r) / ref:.2f}x GenAI  tokens equal to GenAI {same}/{len(outputs[name])}"
        for peer in closest.get(precision, []):
            if name.startswith("dflash") and peer in rates:
                ratio = statistics.median(r) / statistics.median(rates[peer])
                entry[f"vs_{peer.replace(' ', '_')}"] = ratio
                line += f"  {ratio:.2f}x {peer}"
        doc["engines"][name] = entry
        print(line)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(doc, indent=2) + "\n")


if __name__ == "__main__":
    main()
