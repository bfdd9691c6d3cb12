"""Planting bigrams in a DSpark draft's Markov head, so the draft proposes what a target will decode."""

from __future__ import annotations

import re
from pathlib import Path


#: the last stage's Markov factors under V4.1's release names (``embed`` / ``head``) or V4's (``markov_w1`` / ``markov_w2``)
_FACTOR = re.compile(r"^mtp\.(\d+)\.markov_head\.(embed|head|markov_w1|markov_w2)\.weight$")


def plant_bigrams(directory: Path, pairs: dict[int, int], strength: float = 40.0) -> None:
    """Rewrite the draft's Markov head so that after token ``a`` it proposes ``pairs[a]`` (a bias of
    ``strength`` logits; one rank per pair, every other row zero): a draft that agrees with the target
    wherever the target's greedy continuation follows those bigrams. The factors are found in whichever
    ``*.safetensors`` shard holds them."""
    from safetensors.torch import load_file, save_file

    for path in sorted(Path(directory).glob("*.safetensors")):
        tensors = load_file(str(path))
        factors = {m.group(2): (int(m.group(1)), name) for name in tensors if (m := _FACTOR.match(name))}
        if not factors:
            continue
        w1 = tensors[factors.get("embed", factors.get("markov_w1"))[1]]
        w2 = tensors[factors.get("head", factors.get("markov_w2"))[1]]
        if len(pairs) > w1.shape[1]:
            raise ValueError(f"{len(pairs)} bigrams need a Markov rank of at least {len(pairs)}, not {w1.shape[1]}")
        w1.zero_()
        w2.zero_()
        for rank, (a, b) in enumerate(sorted(pairs.items())):
            w1[a, rank] = strength
            w2[b, rank] = 1.0
        save_file(tensors, str(path), metadata={"format": "pt"})
        return
    raise ValueError(f"{directory} holds no DSpark Markov head (mtp.N.markov_head.*)")
