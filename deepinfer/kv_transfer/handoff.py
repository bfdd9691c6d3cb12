"""A prefilled request as bytes for a connector, and back: sized and checksummed, checked before use.

The bytes are a ``torch.save`` of plain containers of tensors, read back with
``weights_only`` (no code runs on load); a payload whose size or BLAKE2 checksum
differs from what the prefill side published is refused, never decoded from.
"""

from __future__ import annotations

import hashlib
import io
from dataclasses import dataclass
from typing import Any

import torch

from ..sampling_params import InvalidRequestError
from .sequence_state import DraftContext, PrefilledRequest, RingRows, SequenceState


@dataclass(frozen=True)
class Handoff:
    """What the decode side needs besides the location: how many bytes, and their checksum."""

    nbytes: int
    checksum: str


def checksum(payload: bytes) -> str:
    return hashlib.blake2b(payload, digest_size=16).hexdigest()


def _rows(r: RingRows) -> dict[str, torch.Tensor]:
    return {"positions": torch.from_numpy(r.positions), "data": r.data}


def _unrows(d: dict[str, torch.Tensor]) -> RingRows:
    return RingRows(d["positions"].numpy(), d["data"])


def encode(prefilled: PrefilledRequest) -> tuple[bytes, Handoff]:
    s = prefilled.state
    tree: dict[str, Any] = {
        "num_tokens": s.num_tokens, "output_token_ids": list(prefilled.output_token_ids),
        "output_logprobs": prefilled.output_logprobs, "storage": s.storage, "blocks": s.blocks,
        "window": [_rows(r) for r in s.window],
        "states": [{b: [_rows(kv), _rows(gate)] for b, (kv, gate) in layer.items()} for layer in s.states],
        "history": _rows(s.history) if s.history is not None else None,
        "draft": None if s.draft is None else {
            "ctx_positions": torch.from_numpy(s.draft.ctx_positions), "ctx": s.draft.ctx,
            "kv_positions": torch.from_numpy(s.draft.kv_positions), "kv": s.draft.kv,
        },
    }
    buf = io.BytesIO()
    torch.save(tree, buf)
    payload = buf.getvalue()
    return payload, Handoff(len(payload), checksum(payload))


def decode(payload: bytes, expected: Handoff) -> PrefilledRequest:
    """The prefilled request in ``payload``; refused (one line) when its size or checksum is not the published one."""
    if len(payload) != expected.nbytes:
        raise InvalidRequestError(f"the transferred KV state has {len(payload)} bytes, not the {expected.nbytes} published; refused")
    if checksum(payload) != expected.checksum:
        raise InvalidRequestError("the transferred KV state fails its checksum (corrupted in transit); refused")
    tree = torch.load(io.BytesIO(payload), weights_only=True)
    d = tree["draft"]
    draft = None if d is None else DraftContext(d["ctx_positions"].numpy(), d["ctx"], d["kv_positions"].numpy(), d["kv"])
    state = SequenceState(
        tree["num_tokens"], tree["blocks"], [_unrows(r) for r in tree["window"]],
        [{b: (_unrows(kv), _unrows(gate)) for b, (kv, gate) in layer.items()} for layer in tree["states"]],
        _unrows(tree["history"]) if tree["history"] is not None else None, draft, tree.get("storage"),
    )
    rows = tree.get("output_logprobs")
    logprobs = None if rows is None else [{int(t): (float(lp), int(rank)) for t, (lp, rank) in row.items()} for row in rows]
    return PrefilledRequest(state, [int(t) for t in tree["output_token_ids"]], logprobs)


__all__ = ["Handoff", "checksum", "decode", "encode"]
