"""A z-lab-format DFlash draft as OpenVINO IR for openvino-genai's DFlash pipeline, with optimum-intel's own classes.

Runs in the OpenVINO GenAI venv (`PEERS_OPENVINO_GENAI=1 bash benchmarks/peers_setup.sh`):

    .bench-ov-venv/bin/python benchmarks/ov_dflash_export.py DRAFT_DIR OUT_DIR [int4]

`optimum-cli export openvino --trust-remote-code` is the documented route, but optimum-intel 2.2.0 reaches its
DFlash class through transformers' remote-code loader, which asks for every package its patcher module names
(diffusers, einops) and copies the module without its relative imports. This loads the same class
(`Qwen3DFlashForCausalLM`) directly and hands it to optimum-intel's exporter: the same graph, the same
`dflash` runtime info (mask token, target layers); fp32 weights, or int4 as NNCF compresses them (group 32, every
layer: what `optimum-cli --weight-format int4 --group-size 32 --ratio 1.0` asks for).
"""

from __future__ import annotations

import sys
from pathlib import Path


def main() -> None:
    import shutil

    import torch
    from optimum.exporters.openvino.convert import export_from_model
    from optimum.exporters.openvino.model_patcher import Qwen3DFlashForCausalLM
    from transformers import AutoConfig

    class Draft(Qwen3DFlashForCausalLM):
        """Defined here so the exporter reads its library as transformers (a class of optimum's own is taken
        for a wrapper and unwrapped)."""

    draft, out = Path(sys.argv[1]), Path(sys.argv[2])
    config = AutoConfig.from_pretrained(draft)
    config.tie_word_embeddings = False  # the head is the target's, grafted on by openvino-genai at load
    # fp32 as optimum-cli loads a checkpoint for export (a bf16 one traces against fp32 example inputs otherwise)
    model = Draft.from_pretrained(draft, config=config, dtype=torch.float32)
    part = out.with_name(out.name + ".part")  # a killed export leaves nothing a rerun would take as done
    shutil.rmtree(part, ignore_errors=True)
    ov_config = None
    if sys.argv[3:] == ["int4"]:
        from optimum.intel import OVConfig, OVWeightQuantizationConfig

        ov_config = OVConfig(quantization_config=OVWeightQuantizationConfig(bits=4, group_size=32, ratio=1.0))
    export_from_model(model, str(part), task="text-generation-with-past", ov_config=ov_config)
    part.rename(out)


if __name__ == "__main__":
    main()
