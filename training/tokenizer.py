"""A byte-level BPE tokenizer trained on the corpus, saved for ``tokenizers`` and transformers alike."""

from __future__ import annotations

import os
from pathlib import Path

BOS_TOKEN = "<|begin▁of▁sentence|>"
EOS_TOKEN = "<|end▁of▁sentence|>"
#: the token DSpark fills the not-yet-drafted positions of a block with
NOISE_TOKEN = "<|noise|>"
SPECIAL_TOKENS = [BOS_TOKEN, EOS_TOKEN, NOISE_TOKEN]


def train_tokenizer(texts: list[str], vocab_size: int, special_tokens: list[str] = SPECIAL_TOKENS):
    """Train byte-level BPE on ``texts``; the specials take the first ids (by default 0, 1, 2: BOS, EOS, noise)."""
    os.environ.setdefault("RAYON_NUM_THREADS", "1")
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=special_tokens,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def save_tokenizer(tok, directory: Path, model_max_length: int) -> None:
    """Write tokenizer.json and tokenizer_config.json that transformers' PreTrainedTokenizerFast loads."""
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        additional_special_tokens=[NOISE_TOKEN],
        model_max_length=model_max_length,
        clean_up_tokenization_spaces=False,
    )
    fast.save_pretrained(str(directory))
