"""openvino-genai as a peer: one LLMPipeline kept loaded, fed prompts as JSON lines on stdin.

Runs in the OpenVINO GenAI venv (`PEERS_OPENVINO_GENAI=1 bash benchmarks/peers_setup.sh`), never in
dflash's: optimum-intel, which converts the checkpoint, pins a transformers older than dflash needs.
`peers_decode.py` starts one worker per model and sends it each round's request, so its rounds stay
interleaved with the other engines'. A request:

    {"ids": [...], "new": 128}                        # plain greedy decode, stopping at end of text
    {"ids": [...], "new": 128, "ignore_eos": true}     # exactly `new` tokens (random weights)
    {"ids": [...], "new": 128, "assistant_tokens": 4}  # with the --draft model, its speculative decoding
                                                       # (a DFlash draft: block size - 1, --no-prefix-caching)

Reply: {"tokens": [...], "ttft_s": ..., "decode_s": ...}, decode time excluding the prompt and the first
token as openvino-genai's own performance metrics measure them; with a draft, also its target calls and
acceptance rate.
"""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np
import openvino as ov
import openvino_genai as ov_genai


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--draft", help="an OpenVINO IR draft model for openvino-genai's speculative decoding")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--no-prefix-caching", action="store_true", help="what its DFlash pipeline asks for")
    args = ap.parse_args()
    props = {"INFERENCE_NUM_THREADS": args.threads}
    if args.draft:
        props["draft_model"] = ov_genai.draft_model(args.draft, "CPU", INFERENCE_NUM_THREADS=args.threads)
    if args.no_prefix_caching:
        scheduler = ov_genai.SchedulerConfig()
        scheduler.enable_prefix_caching = False
        props["scheduler_config"] = scheduler
    pipe = ov_genai.LLMPipeline(args.model, "CPU", **props)
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        ids = np.array([req["ids"]], dtype=np.int64)
        inputs = ov_genai.TokenizedInputs(ov.Tensor(ids), ov.Tensor(np.ones_like(ids)))
        config = ov_genai.GenerationConfig()
        config.max_new_tokens = req["new"]
        config.ignore_eos = bool(req.get("ignore_eos"))
        config.do_sample = False
        if req.get("assistant_tokens"):
            config.num_assistant_tokens = req["assistant_tokens"]
        res = pipe.generate(inputs, config)
        pm = res.perf_metrics
        ttft = pm.get_ttft().mean / 1000
        total = pm.get_generate_duration().mean / 1000
        tokens = [int(t) for t in res.tokens[0]]
        reply = {"tokens": tokens, "ttft_s": ttft, "decode_s": total - ttft}
        if args.draft:  # target calls, for tokens per target call; openvino-genai's own counts
            sd = res.extended_perf_metrics
            reply["target_calls"] = len(sd.main_model_metrics.raw_metrics.m_durations)
            reply["draft_acceptance_rate"] = sd.get_draft_acceptance_rate()
        print(json.dumps(reply), flush=True)


if __name__ == "__main__":
    main()
