"""Byte-level BPE tokenizer for the demo pair, saved in Hugging Face format."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

EOS_TOKEN = "<|endoftext|>"
MASK_TOKEN = "<|mask|>"


def train_tokenizer(texts: Iterable[str], out_dir: Path, vocab_size: int = 4096) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TOKEN, MASK_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token=EOS_TOKEN, bos_token=EOS_TOKEN, pad_token=EOS_TOKEN, mask_token=MASK_TOKEN
    )
    fast.model_max_length = 2048
    out_dir.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(out_dir))
