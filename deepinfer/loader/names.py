"""One table from checkpoint tensor names to the model's parameter names.

The model's names are those transformers' ``save_pretrained`` writes for
DeepSeek-V4 (``model.layers.N.attn.wq_a.weight``), so those load unchanged.
DeepSeek's own release (and its ``inference/`` code) names the same tensors
without the ``model.`` prefix, calls the embedding ``embed``, the final norm and
head collapse top-level tensors, and the attention's kv norm ``kv_norm``; block
scales sit beside their weights as ``.scale`` (V4) or ``_scale_inv`` (V3).

transformers' DeepSeek V4.1 spells the embedding ``model.embed``, the kv norm
``kv_norm`` and the head ``lm_head``; those load too. V4.1's vision tower keeps
its release names (``vision.*``, ``aligner.*``, ``image_start`` / ``image_newline``
/ ``image_end``); exports that put them under ``model.`` load too.

``mtp.*`` (the DSpark draft) keeps its release names. Other spellings of the
draft's tensors load under them too: transformers' (``hc_head.hc_fn``, a stage's
kv norm as ``attn.norm``), V3-style ``weight_scale_inv`` scales, and the Markov
head as ``markov_head.embed`` / ``markov_head.proj`` (deepinfer's earlier names)
or ``markov_head.head`` (DeepSeek V4.1's release).
"""

from __future__ import annotations

import re

#: (published pattern, model name) in order; the first match wins; names no rule matches are unchanged
RULES: tuple[tuple[str, str], ...] = (
    (r"^embed\.(weight|scale)$", r"model.embed_tokens.\1"),
    (r"^norm\.weight$", "model.norm.weight"),
    (r"^hc_head_(fn|base|scale)$", r"model.hc_head.hc_\1"),
    (r"^layers\.(\d+)\.attn\.kv_norm\.weight$", r"model.layers.\1.attn.norm.weight"),
    (r"^layers\.(\d+)\.(.+)$", r"model.layers.\1.\2"),
    (r"^model\.embed\.weight$", "model.embed_tokens.weight"),
    (r"^model\.layers\.(\d+)\.attn\.kv_norm\.weight$", r"model.layers.\1.attn.norm.weight"),
    (r"^lm_head\.weight$", "head.weight"),
    (r"^model\.((?:vision|aligner)\..+|image_(?:start|newline|end))$", r"\1"),
)

#: (other spelling, release name) of the DSpark draft's tensors, the first match wins
DRAFT_RULES: tuple[tuple[str, str], ...] = (
    (r"^mtp\.(\d+)\.attn\.norm\.weight$", r"mtp.\1.attn.kv_norm.weight"),
    (r"^mtp\.(\d+)\.hc_head\.hc_(fn|base|scale)$", r"mtp.\1.hc_head_\2"),
    (r"^mtp\.(\d+)\.markov_head\.embed\.weight$", r"mtp.\1.markov_head.markov_w1.weight"),
    (r"^mtp\.(\d+)\.markov_head\.proj\.weight$", r"mtp.\1.markov_head.markov_w2.weight"),
    (r"^mtp\.(\d+)\.markov_head\.head\.weight$", r"mtp.\1.markov_head.markov_w2.weight"),
)

_COMPILED = tuple((re.compile(p), r) for p, r in RULES)
_DRAFT = tuple((re.compile(p), r) for p, r in DRAFT_RULES)


def _first_rule(name: str, rules) -> str:
    for pattern, replacement in rules:
        if pattern.match(name):
            return pattern.sub(replacement, name)
    return name


def model_name(name: str) -> str:
    """The model parameter a checkpoint tensor ``name`` loads into (``name`` itself when no rule applies).

    A V3-style block scale ``X.weight_scale_inv`` is named ``X.scale``, as V4 names it.
    """
    if name.endswith(".weight_scale_inv"):
        name = name[: -len("weight_scale_inv")] + "scale"
    return _first_rule(name, _DRAFT if name.startswith("mtp.") else _COMPILED)

