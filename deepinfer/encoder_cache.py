"""Image embeddings a runner keeps between steps: each image encoded once, held while a prompt still needs it.

The model encodes an image into its whole span's rows (``[span.length, hidden]``,
delimiters included). A chunked prefill reads a span over several steps, and a
replay after a prefix hit, a preempted request's recompute or a parallel
completion that prefills on its own read it again: the rows are kept, keyed by
the image's digest, while a request whose prompt has not passed the span holds
them, then kept a while longer among the retired ones (least recently used
first out, at most ``retain_rows`` rows in all) for such returns.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable

import torch

from .multimodal import ImageSpan

#: rows of retired images kept for a later replay or recompute (a few images of the release's size)
RETAIN_ROWS = 4096


class EncoderCache:
    def __init__(self, retain_rows: int = RETAIN_ROWS) -> None:
        self.retain_rows = retain_rows
        #: digest -> rows, for images some request still needs
        self.live: dict[bytes, torch.Tensor] = {}
        #: digest -> the requests holding it
        self.holders: dict[bytes, set[str]] = {}
        #: digest -> rows nobody holds, least recently used first
        self.retired: OrderedDict[bytes, torch.Tensor] = OrderedDict()
        self._retired_rows = 0

    def __contains__(self, digest: bytes) -> bool:
        return digest in self.live or digest in self.retired

    def ensure(self, spans: Iterable[ImageSpan], encode: Callable[[list[ImageSpan]], list[torch.Tensor]]) -> int:
        """Encode the images of ``spans`` not held yet, all in one ``encode`` call; how many it encoded."""
        missing: dict[bytes, ImageSpan] = {}
        for span in spans:
            if span.digest not in self and span.digest not in missing:
                missing[span.digest] = span
        if not missing:
            return 0
        rows = encode(list(missing.values()))
        for span, r in zip(missing.values(), rows):
            if tuple(r.shape[:1]) != (span.length,):
                raise ValueError(f"an image of {span.length} span positions was encoded into {tuple(r.shape)} rows")
            self.live[span.digest] = r
        return len(missing)

    def rows(self, digest: bytes) -> torch.Tensor:
        """The span rows of an image (a retired one comes back live)."""
        r = self.live.get(digest)
        if r is None:
            r = self.retired.pop(digest)
            self._retired_rows -= r.shape[0]
            self.live[digest] = r
        return r

    def hold(self, request_id: str, digest: bytes) -> None:
        self.holders.setdefault(digest, set()).add(request_id)

    def release(self, request_id: str, digest: bytes) -> None:
        """``request_id`` is past the image's span: the rows retire once nobody else holds them."""
        users = self.holders.get(digest)
        if users is not None:
            users.discard(request_id)
        if not users:
            self.holders.pop(digest, None)
            self._retire(digest)

    def forget(self, request_id: str) -> None:
        """A finished request holds nothing."""
        for digest in [d for d, users in self.holders.items() if request_id in users]:
            self.release(request_id, digest)

    def _retire(self, digest: bytes) -> None:
        r = self.live.pop(digest, None)
        if r is None:
            return
        self.retired[digest] = r
        self._retired_rows += r.shape[0]
        while self._retired_rows > self.retain_rows and self.retired:
            _, old = self.retired.popitem(last=False)
            self._retired_rows -= old.shape[0]
