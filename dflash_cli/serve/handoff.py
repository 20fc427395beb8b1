"""The command that serves the same pair in vLLM or SGLang (when one machine is not enough).

Flags are the engines' documented ones (z-lab's README: vLLM `--speculative-config` with method
"dflash" and num_speculative_tokens = block_size - 1; SGLang `--speculative-algorithm DFLASH`
with `--speculative-num-draft-tokens` = block_size). Checkpoints are named as the recipe names
them: a local directory as an absolute path, a Hugging Face repo id as is.
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path
from typing import Any

from dflash_cli.errors import CheckpointError
from dflash_cli.families import family_named

ENGINES = ("vllm", "sglang")


def handoff_command(recipe: Any, engine: str, model_name: str | None = None) -> str:
    target, draft = _where(recipe.target.path), _where(recipe.draft.path)
    block = _block_size(recipe)
    name = model_name or recipe.name
    q = shlex.quote
    if engine == "vllm":
        spec = json.dumps({"method": "dflash", "model": draft, "num_speculative_tokens": block - 1})
        lines = [
            f"vllm serve {q(target)}",
            f"--served-model-name {q(name)}",
            f"--speculative-config {q(spec)}",
            f"--max-model-len {recipe.export.ctx_len}",
        ]
    else:
        lines = [
            "python -m sglang.launch_server",
            f"--model-path {q(target)}",
            f"--served-model-name {q(name)}",
            "--speculative-algorithm DFLASH",
            f"--speculative-draft-model-path {q(draft)}",
            f"--speculative-num-draft-tokens {block}",
            f"--context-length {recipe.export.ctx_len}",
            "--trust-remote-code",  # the z-lab drafts' model code ships with the checkpoint
        ]
    notes = [f"# {engine}: serves {recipe.name} (block size {block}) as {name!r} on the OpenAI API"]
    if family_named(recipe.family).thinking_switch and recipe.run.chat_template and not recipe.run.enable_thinking:
        notes.append('# chat clients: send "chat_template_kwargs": {"enable_thinking": false}, as this recipe does')
    return "\n".join(notes + [" \\\n  ".join(lines)])


def _where(path_or_repo: str) -> str:
    local = Path(path_or_repo).expanduser()
    return str(local.resolve()) if local.is_dir() else path_or_repo


def _block_size(recipe: Any) -> int:
    if recipe.dflash.block_size is not None:
        return int(recipe.dflash.block_size)
    from dflash_cli.checkpoints.locate import load_config, resolve_checkpoint_dir

    draft_dir = resolve_checkpoint_dir(recipe.draft.path, "draft")
    block = load_config(draft_dir).get("block_size")
    if not isinstance(block, int):
        raise CheckpointError(f"the draft's config.json has no block_size: {draft_dir}", hint="set dflash.block_size")
    return block
