"""Model directories for chat tests: the bundled weights with a DeepSeek-V4 chat tokenizer.

Two tokenizers, both prepending BOS when special tokens are added (as DeepSeek's
does, so a double BOS would show):

- ``save_v4_chat_tokenizer``: byte-level, ids known without running it — the
  bundled model's BOS / EOS / noise tokens at 0, 1, 2, byte ``b`` at
  ``BYTE_OFFSET + b``, then the V4 chat tokens (``IDS``). For exact-id checks.
- ``save_bundled_chat_tokenizer``: the bundled model's own BPE with its special
  tokens renamed to the V4 spellings and its last four merges given up for the
  chat tokens (``BUNDLED_IDS``), so the model's replies decode to real text.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from deepinfer.engine import BUNDLED_MODEL

BOS, EOS, NOISE = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<|noise|>"
BYTE_OFFSET = 3
USER, ASSISTANT, THINK, END_THINK = "<｜User｜>", "<｜Assistant｜>", "<think>", "</think>"
#: token -> id, written down here rather than read back from the tokenizer
IDS = {BOS: 0, EOS: 1, NOISE: 2, USER: 259, ASSISTANT: 260, THINK: 261, END_THINK: 262}


def byte_ids(text: str) -> list[int]:
    """The ids this tokenizer gives plain text: one per UTF-8 byte."""
    return [BYTE_OFFSET + b for b in text.encode("utf-8")]


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table, which the ByteLevel pre-tokenizer uses."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def save_v4_chat_tokenizer(directory: Path, chat_tokens: bool = True, chat_template: str | None = None) -> None:
    """tokenizer.json and tokenizer_config.json in ``directory`` (without the V4 chat tokens when ``chat_tokens`` is False)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    specials = [BOS, EOS, NOISE] + ([USER, ASSISTANT] if chat_tokens else [])
    plain = [THINK, END_THINK] if chat_tokens else []
    vocab = {t: IDS[t] for t in specials + plain}
    vocab.update({ch: BYTE_OFFSET + b for b, ch in _bytes_to_unicode().items()})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, normalized=False) for t in specials])
    tok.add_tokens([AddedToken(t, normalized=False, special=False) for t in plain])  # DeepSeek's <think> tokens are not special
    tok.post_processor = processors.TemplateProcessing(single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, IDS[BOS])])
    tok.save(str(directory / "tokenizer.json"))
    config = {"bos_token": BOS, "eos_token": EOS, "model_max_length": 1024, "tokenizer_class": "PreTrainedTokenizerFast"}
    if chat_template is not None:
        config["chat_template"] = chat_template
    (directory / "tokenizer_config.json").write_text(json.dumps(config, ensure_ascii=False), encoding="utf-8")


#: the chat tokens' ids in the bundled-BPE variant: the ids of the four merges it drops
BUNDLED_IDS = {BOS: 0, EOS: 1, USER: 4092, ASSISTANT: 4093, THINK: 4094, END_THINK: 4095}


def save_bundled_chat_tokenizer(directory: Path) -> None:
    """The bundled tokenizer with V4 special-token spellings and the V4 chat tokens (see the module doc)."""
    data = json.loads((BUNDLED_MODEL / "tokenizer.json").read_text(encoding="utf-8"))
    model = data["model"]
    renamed = {model_token: v4 for model_token, v4 in (("<|begin▁of▁sentence|>", BOS), ("<|end▁of▁sentence|>", EOS))}
    model["vocab"] = {renamed.get(t, t): i for t, i in model["vocab"].items()}
    for added in data["added_tokens"]:
        added["content"] = renamed.get(added["content"], added["content"])
    freed = {i for t, i in model["vocab"].items() if i >= 4092}
    model["merges"] = model["merges"][: len(model["merges"]) - len(freed)]
    model["vocab"] = {t: i for t, i in model["vocab"].items() if i not in freed}
    for token in (USER, ASSISTANT, THINK, END_THINK):
        model["vocab"][token] = BUNDLED_IDS[token]
        data["added_tokens"].append(
            {"id": BUNDLED_IDS[token], "content": token, "single_word": False, "lstrip": False, "rstrip": False,
             "normalized": False, "special": token in (USER, ASSISTANT)}
        )
    data["post_processor"] = {
        "type": "TemplateProcessing",
        "single": [{"SpecialToken": {"id": BOS, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [{"SpecialToken": {"id": BOS, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {BOS: {"id": BOS, "ids": [0], "tokens": [BOS]}},
    }
    (directory / "tokenizer.json").write_text(json.dumps(data, ensure_ascii=False), encoding="utf-8")
    config = {"bos_token": BOS, "eos_token": EOS, "model_max_length": 1024, "tokenizer_class": "PreTrainedTokenizerFast"}
    (directory / "tokenizer_config.json").write_text(json.dumps(config, ensure_ascii=False), encoding="utf-8")


def v4_chat_model(
    directory: Path, chat_tokens: bool = True, chat_template: str | None = None, tokenizer: str = "bytes"
) -> Path:
    """A model directory in ``directory``: the bundled config and weights (linked) with a chat tokenizer,
    ``tokenizer="bytes"`` (``save_v4_chat_tokenizer``) or ``"bundled"`` (``save_bundled_chat_tokenizer``)."""
    without_chat_format(directory, keep_tokenizer=False)
    if tokenizer == "bundled":
        save_bundled_chat_tokenizer(directory)
    else:
        save_v4_chat_tokenizer(directory, chat_tokens, chat_template)
    return directory


def without_chat_format(directory: Path, keep_tokenizer: bool = True) -> Path:
    """The bundled model in ``directory`` (weights linked) without its chat template: a model that has no chat
    format (its tokenizer lacks the V4 chat tokens); ``keep_tokenizer=False`` leaves the tokenizer files out too."""
    directory.mkdir(parents=True, exist_ok=True)
    for f in BUNDLED_MODEL.iterdir():
        if f.name.startswith("chat_template") or (f.name.startswith("tokenizer") and not keep_tokenizer):
            continue
        if f.suffix == ".safetensors":
            (directory / f.name).symlink_to(f.resolve())
        else:
            shutil.copy(f, directory / f.name)
    return directory
