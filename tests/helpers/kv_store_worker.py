"""One engine process on a KV store, for the store's multi-process tests.

    python -m tests.helpers.kv_store_worker SPEC.json

SPEC: model, store, prompts (token ids), engine (extra ``LLM`` keywords),
max_tokens, and optionally fsize_limit (bytes: no file this process writes may
grow past it, as on a full disk; set after start-up, SIGXFSZ ignored so the
write fails with EFBIG). Prints one JSON line: each prompt's tokens, the
engine's metrics and the warnings it logged.
"""

from __future__ import annotations

import json
import logging
import resource
import signal
import sys

from deepinfer.llm import LLM
from deepinfer.sampling_params import SamplingParams


class _Warnings(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def main(spec_path: str) -> None:
    spec = json.loads(open(spec_path).read())
    warnings = _Warnings()
    logging.getLogger("deepinfer").addHandler(warnings)
    llm = LLM(model=spec["model"], backend="cpu", kv_store=spec["store"], **spec.get("engine", {}))
    if spec.get("fsize_limit"):
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (spec["fsize_limit"], resource.RLIM_INFINITY))
    params = SamplingParams(temperature=0, max_tokens=spec.get("max_tokens", 6), ignore_eos=True, cache_class=spec.get("cache_class"))
    tokens = []
    for prompt in spec["prompts"]:  # one at a time: each later prompt may hit what the earlier ones stored
        tokens.append(llm.generate([prompt], params)[0].outputs[0].token_ids)
    llm.close()
    print(json.dumps({"tokens": tokens, "metrics": llm.get_metrics(), "warnings": warnings.lines}))


if __name__ == "__main__":
    main(sys.argv[1])
