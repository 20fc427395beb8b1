"""The target's tokenizer, loaded as Hugging Face loads it from the user's checkpoint.

Hugging Face takes a tokenizer's class from tokenizer_config.json and, where that names the generic backend,
from the checkpoint's model type. The config.json convert writes is the text path's, whose model type differs
for a multimodal checkpoint (a Qwen3.5 one resolves `Qwen3_5Tokenizer`, which splits text otherwise than the
generic backend), so the checkpoint's own config, kept as source_config.json, decides the class.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dflash_cli.checkpoints.locate import SOURCE_CONFIG_FILE


def load_tokenizer(target_dir: Path) -> Any:
    from transformers import AutoConfig, AutoTokenizer

    source = Path(target_dir) / SOURCE_CONFIG_FILE
    if not source.is_file():  # config.json is the checkpoint's own
        return AutoTokenizer.from_pretrained(str(target_dir))
    return AutoTokenizer.from_pretrained(str(target_dir), config=AutoConfig.from_pretrained(str(source)))
