"""The offline Python API, shaped like vLLM's ``LLM``."""

from __future__ import annotations

from typing import Any, Iterator, Mapping, Sequence

from tokenizers import Tokenizer

from .config import load_config
from .engine import Engine
from .outputs import RequestOutput
from .sampling_params import SamplingParams

Prompt = str | list[int]
Params = SamplingParams | Mapping[str, Any]


class LLM:
    """An engine instance: ``LLM(model=DIR, backend="cpu", **any EngineConfig field)``.

    Settings not given as keywords come from ``DEEPINFER_<FIELD>`` environment
    variables, then the config file (``config=PATH`` or ``DEEPINFER_CONFIG``).
    """

    def __init__(self, model: str | None = None, *, config: str | None = None, **kwargs: Any) -> None:
        self.config = load_config({"model": model, **kwargs}, config)
        self.engine = Engine(self.config)

    def get_tokenizer(self) -> Tokenizer:
        return self.engine.tokenizer

    def get_metrics(self) -> dict[str, Any]:
        """The engine's counters: steps, tokens computed, prefix hits, preemptions, step times, graph replays, ..."""
        return self.engine.get_metrics()

    def _submit(self, prompts: Prompt | Sequence[Prompt], params: Params | Sequence[Params] | None) -> list[str]:
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        prompts = list(prompts)
        if params is None or isinstance(params, (SamplingParams, Mapping)):
            per = [params] * len(prompts)
        else:
            per = list(params)
            if len(per) != len(prompts):
                raise ValueError(f"got {len(prompts)} prompts but {len(per)} sampling params; give one, or one per prompt")
        return [self.engine.add_request(p, sp).request_id for p, sp in zip(prompts, per)]

    def generate_stream(
        self, prompts: Prompt | Sequence[Prompt], sampling_params: Params | Sequence[Params] | None = None
    ) -> Iterator[RequestOutput]:
        """Yield a ``RequestOutput`` snapshot each time a request gains tokens or finishes.

        Requests that fail validation are yielded first, finished, with ``error`` set.
        """
        ids = self._submit(prompts, sampling_params)
        reqs = [self.engine.requests[i] for i in ids]
        for req in reqs:
            if req.all_finished:
                yield self.engine.output(req)
        pending = {r.request_id for r in reqs if not r.all_finished}
        try:
            while pending:
                for req in self.engine.step():
                    if req.request_id in pending:
                        yield self.engine.output(req)
                        if req.all_finished:
                            pending.discard(req.request_id)
        finally:
            for rid in pending:  # the caller stopped iterating: abort what is left
                self.engine.abort(rid)
            self.engine.release(ids)

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: Params | Sequence[Params] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Complete every prompt (text or token ids); outputs come back in prompt order.

        A request with bad input (empty or too long prompt, token ids outside the
        vocabulary, an invalid sampling value given as a mapping) does not raise:
        its ``RequestOutput.error`` holds the one-line reason and every other
        request completes. ``SamplingParams(...)`` itself raises on invalid values.
        """
        ids = self._submit(prompts, sampling_params)
        bar = _Progress(len(ids)) if use_tqdm else None
        done = sum(self.engine.requests[i].all_finished for i in ids)
        while any(not self.engine.requests[i].all_finished for i in ids):
            for req in self.engine.step():
                if req.all_finished and bar is not None:
                    done += 1
                    bar.update(done)
        if bar is not None:
            bar.close()
        outputs = [self.engine.output(self.engine.requests[i]) for i in ids]
        self.engine.release(ids)
        return outputs


class _Progress:
    """A one-line progress bar on stderr."""

    def __init__(self, total: int) -> None:
        import sys

        self.total = total
        self.out = sys.stderr

    def update(self, done: int) -> None:
        width = 30
        filled = int(width * done / max(self.total, 1))
        self.out.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {done}/{self.total} requests")
        self.out.flush()

    def close(self) -> None:
        self.out.write("\n")
