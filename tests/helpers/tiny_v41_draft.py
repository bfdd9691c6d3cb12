"""A tiny random DeepSeek V4.1 checkpoint with its three DSpark draft stages (``mtp.0`` .. ``mtp.2``).

The backbone is ``tiny_v41``'s (eight layers, every role); ``text_config`` adds the
draft's fields (three stages, sliding-window only, a 4-expert MoE) and a second
shard, ``mtp.safetensors``, holds the stages under the release's names, listed
here from the config alone (not from the engine's parameters), so a naming or
shape slip in the draft fails to load. The loader reads every ``*.safetensors``
of the directory.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from safetensors.torch import save_file

from tests.helpers.tiny_v41 import TEXT, _random, write_tiny_v41

STAGES = 3
DRAFT_EXPERTS = 4
DRAFT_FIELDS: dict[str, Any] = dict(
    num_nextn_predict_layers=STAGES,
    compress_ratios=TEXT["compress_ratios"] + [0] * STAGES,
    dspark_target_layer_ids=[3, 5, 7],
    dspark_n_routed_experts=DRAFT_EXPERTS,
    dspark_num_experts_per_tok=2,
    dspark_block_size=4,
    dspark_noise_token_id=TEXT["vocab_size"] - 1,
    dspark_markov_rank=8,
)


def stage_shapes(t: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """One stage's tensors (names within ``mtp.{i}.``) and shapes: a sliding-window V4.1 layer with the
    draft's routed experts."""
    d, n, i = t["hidden_size"], t["hc_mult"], t["moe_intermediate_size"]
    heads, hd, e = t["num_attention_heads"], t["head_dim"], t["dspark_n_routed_experts"]
    out = {
        "attn.wq_a.weight": (t["q_lora_rank"], d), "attn.q_norm.weight": (t["q_lora_rank"],),
        "attn.wq_b.weight": (heads * hd, t["q_lora_rank"]), "attn.wkv.weight": (hd, d), "attn.kv_norm.weight": (hd,),
        "attn.wo_a.weight": (t["o_groups"] * t["o_lora_rank"], heads * hd // t["o_groups"]),
        "attn.wo_b.weight": (d, t["o_groups"] * t["o_lora_rank"]), "attn.attn_sink": (heads,),
        "ffn.gate.weight": (e, d), "ffn.gate.bias": (e,), "ffn.gate.bias_vl": (e,),
        "ffn.shared_experts.w1.weight": (i, d), "ffn.shared_experts.w3.weight": (i, d), "ffn.shared_experts.w2.weight": (d, i),
        "attn_norm.weight": (d,), "ffn_norm.weight": (d,),
    }
    for x in range(e):
        out |= {f"ffn.experts.{x}.w1.weight": (i, d), f"ffn.experts.{x}.w3.weight": (i, d), f"ffn.experts.{x}.w2.weight": (d, i)}
    for site in ("attn", "ffn"):
        out |= {f"hc_{site}_fn": ((2 + n) * n, n * d), f"hc_{site}_base": ((2 + n) * n,), f"hc_{site}_scale": (3,)}
    return out


def draft_shapes(t: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Every ``mtp.*`` tensor of the draft and its shape, under the release's names: the stages, the context
    projection on the first, the final norm and the Markov and confidence heads on the last (no ``hc_head``:
    V4.1 has none; the Markov factors are ``markov_head.embed`` / ``markov_head.head``)."""
    d, v, r, stages = t["hidden_size"], t["vocab_size"], t["dspark_markov_rank"], t["num_nextn_predict_layers"]
    out = {f"mtp.{s}.{name}": shape for s in range(stages) for name, shape in stage_shapes(t).items()}
    last = f"mtp.{stages - 1}"
    out |= {
        "mtp.0.main_proj.weight": (d, len(t["dspark_target_layer_ids"]) * d), "mtp.0.main_norm.weight": (d,),
        f"{last}.norm.weight": (d,), f"{last}.markov_head.embed.weight": (v, r),
        f"{last}.markov_head.head.weight": (v, r), f"{last}.confidence_head.proj.weight": (1, d + r),
    }
    return out


def write_tiny_v41_draft(directory: Path, seed: int = 0, **text: Any) -> Path:
    """Write the tiny V4.1 checkpoint with ``DRAFT_FIELDS`` (``text`` overrides them) and its ``mtp.safetensors``
    shard of random fp32 draft tensors, seeded; returns the directory."""
    directory = write_tiny_v41(directory, seed=seed, **{**DRAFT_FIELDS, **text})
    fields = json.loads((directory / "config.json").read_text())["text_config"]
    tensors = {name: _random(name, shape, seed + 1).float() for name, shape in sorted(draft_shapes(fields).items())}
    save_file(tensors, str(directory / "mtp.safetensors"))
    return directory

