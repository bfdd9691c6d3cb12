"""One table from checkpoint tensor names to the model's parameter names.

The model's names are those transformers' ``save_pretrained`` writes for
DeepSeek-V4 (``model.layers.N.attn.wq_a.weight``), so those load unchanged.
DeepSeek's own release (and its ``inference/`` code) names the same tensors
without the ``model.`` prefix, calls the embedding ``embed``, the final norm and
head collapse top-level tensors, and the attention's kv norm ``kv_norm``; block
scales sit beside their weights as ``.scale`` (V4) or ``_scale_inv`` (V3).
``mtp.*`` (the DSpark draft) keeps its release names.
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
)

_COMPILED = tuple((re.compile(p), r) for p, r in RULES)


def model_name(name: str) -> str:
    """The model parameter a checkpoint tensor ``name`` loads into (``name`` itself when no rule applies).

    A V3-style block scale ``X.weight_scale_inv`` is named ``X.scale``, as V4 names it.
    """
    if name.startswith("mtp."):
        return name
    if name.endswith(".weight_scale_inv"):
        name = name[: -len("weight_scale_inv")] + "scale"
    for pattern, replacement in _COMPILED:
        if pattern.match(name):
            return pattern.sub(replacement, name)
    return name
