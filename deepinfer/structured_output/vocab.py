"""The checkpoint tokenizer's vocabulary as xgrammar needs it, read from the local tokenizer only.

xgrammar matches each token by the bytes it decodes to. It learns them from the
token spellings plus the vocabulary type (byte-level BPE, byte-fallback
SentencePiece or raw). Special tokens other than the stop token are spelled as
the empty string, which xgrammar never allows, so a grammar can never emit e.g.
a chat-template marker as if it were text. Ids the model has but the tokenizer
lacks (a padded vocabulary) are empty as well.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from tokenizers import Tokenizer

from .xgrammar_import import import_xgrammar

BYTE_LEVEL = "byte_level"
BYTE_FALLBACK = "byte_fallback"
RAW = "raw"


def byte_level_alphabet() -> list[str]:
    """The character byte-level BPE spells byte ``b`` with, for ``b`` in 0..255.

    Printable bytes stand for themselves; the others are shifted, in order, to
    code points from 256 on.
    """
    kept = set(range(ord("!"), ord("~") + 1)) | set(range(0xA1, 0xAC + 1)) | set(range(0xAE, 0xFF + 1))
    chars, shifted = [], 0
    for b in range(256):
        if b in kept:
            chars.append(chr(b))
        else:
            chars.append(chr(256 + shifted))
            shifted += 1
    return chars


_BYTE_LEVEL = byte_level_alphabet()


def _nodes(node: Any) -> list[dict]:
    """A tokenizer.json pipeline node and, depth first, the nodes of the sequences inside it."""
    if not isinstance(node, dict):
        return []
    out = [node]
    for key in ("decoders", "pretokenizers", "normalizers"):
        for child in node.get(key) or []:
            out += _nodes(child)
    return out


def _types(node: Any) -> set[str]:
    """Every component ``type`` in a tokenizer.json pipeline node, descending into sequences."""
    return {n["type"] for n in _nodes(node) if isinstance(n.get("type"), str)}


@dataclass(frozen=True)
class VocabLayout:
    """How the tokenizer spells tokens: the vocabulary type and whether it prepends a space."""

    vocab_type: str
    add_prefix_space: bool


def detect_layout(spec: dict) -> VocabLayout:
    """The vocabulary type from the decoder, and the prepended space from the normalizer / pre-tokenizer."""
    decoder = _types(spec.get("decoder"))
    model = spec.get("model") or {}
    if "ByteLevel" in decoder:
        return VocabLayout(BYTE_LEVEL, False)
    prefix = False
    for node in _nodes(spec.get("normalizer")) + _nodes(spec.get("pre_tokenizer")):
        if node.get("type") == "Prepend" and node.get("prepend") == "▁":
            prefix = True
        if node.get("type") == "Metaspace":
            scheme = node.get("prepend_scheme")
            prefix |= scheme in ("always", "first") if scheme is not None else bool(node.get("add_prefix_space"))
    if "ByteFallback" in decoder or model.get("byte_fallback"):
        return VocabLayout(BYTE_FALLBACK, prefix)
    return VocabLayout(RAW, prefix)


def _spell_added(content: str, vocab_type: str) -> str:
    """An added token's literal text spelled the way the vocabulary type decodes it."""
    if vocab_type == BYTE_LEVEL:
        return "".join(_BYTE_LEVEL[b] for b in content.encode("utf-8"))
    if vocab_type == BYTE_FALLBACK:
        return content.replace(" ", "▁")
    return content


def _spellings(tokenizer: Tokenizer, vocab_size: int) -> list[str]:
    """Each model token id's entry in the tokenizer's vocabulary, ``""`` where it has none."""
    vocab = [""] * vocab_size
    for token, idx in tokenizer.get_vocab(with_added_tokens=True).items():
        if 0 <= idx < vocab_size:
            vocab[idx] = token
    return vocab


def encoded_vocab(
    tokenizer: Tokenizer, vocab_size: int, stop_ids: set[int], layout: VocabLayout, spec: dict
) -> list[str]:
    """One spelling per model token id; special tokens and ids the tokenizer lacks are ``""``."""
    vocab = _spellings(tokenizer, vocab_size)
    for added in spec.get("added_tokens") or []:
        idx = added.get("id")
        if not isinstance(idx, int) or not 0 <= idx < vocab_size:
            continue
        vocab[idx] = "" if added.get("special") else _spell_added(added["content"], layout.vocab_type)
    for idx in stop_ids:
        vocab[idx] = ""
    return vocab


def build_tokenizer_info(tokenizer: Tokenizer, vocab_size: int, eos_token_id: int | None) -> Any:
    """An ``xgrammar.TokenizerInfo`` of ``vocab_size`` ids whose stop token is ``eos_token_id``.

    With no ``eos_token_id``, xgrammar picks the conventional end tokens (``</s>``,
    ``<|endoftext|>``, ...) from the vocabulary; ``ValueError`` if it finds none.
    """
    xgr = import_xgrammar()
    spec = json.loads(tokenizer.to_str())
    layout = detect_layout(spec)
    vocab_type = {
        BYTE_LEVEL: xgr.VocabType.BYTE_LEVEL,
        BYTE_FALLBACK: xgr.VocabType.BYTE_FALLBACK,
        RAW: xgr.VocabType.RAW,
    }[layout.vocab_type]

    def info(vocab: list[str], stop: list[int] | None) -> Any:
        return xgr.TokenizerInfo(
            vocab, vocab_type, vocab_size=vocab_size, stop_token_ids=stop, add_prefix_space=layout.add_prefix_space
        )

    if eos_token_id is not None:
        stop = [eos_token_id]
    else:
        stop = list(info(_spellings(tokenizer, vocab_size), None).stop_token_ids)
        if not stop:
            raise ValueError("the vocabulary has no recognisable end-of-sequence token; pass eos_token_id")
    return info(encoded_vocab(tokenizer, vocab_size, set(stop), layout, spec), stop)
