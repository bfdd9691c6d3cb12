"""The ``deepinfer`` command line: ``backends``, ``conformance``, ``generate``.

User errors print one line and exit with status 2, never a traceback.
"""

from __future__ import annotations

import argparse
import json
import sys

from .config import load_config
from .errors import DeepInferError


def _cmd_backends(args: argparse.Namespace) -> int:
    from .registry import discover, list_backends

    statuses = list_backends()
    kernel_sets = discover("kernels")
    if args.json:
        print(json.dumps([s.as_dict() for s in statuses], indent=2))
        return 0
    for s in statuses:
        state = "available" if s.available else f"unavailable: {s.reason}"
        parts = ", ".join(f"{k}={v}" for k, v in s.parts.items())
        print(f"{s.name:<10} {state}")
        if parts:
            print(f"{'':<10} parts: {parts}; interface {s.interface_version}; package {s.package}")
            print(f"{'':<10} own kernels: {', '.join(s.overrides) if s.overrides else 'none (reference everywhere)'}")
            kernel_set = kernel_sets.get(s.parts["kernels"])
            paths = getattr(kernel_set.obj, "paths", None) if kernel_set else None
            if callable(paths):  # a kernel set that says how each op runs (e.g. torch_npu fused op or Triton)
                print(f"{'':<10} kernel paths: {', '.join(f'{op}={how}' for op, how in paths().items())}")
    return 0


def _cmd_conformance(args: argparse.Namespace) -> int:
    from deepinfer_conformance.cli import run

    cfg = load_config({"backend": args.backend, "kernels": args.kernels, "interpret": args.interpret or None}, args.config)
    return run(args, cfg.backend, cfg.interpret)


def _read_prompts(args: argparse.Namespace) -> list[str]:
    from .errors import ConfigError

    prompts = list(args.prompt or [])
    if args.prompts_file:
        try:
            with open(args.prompts_file) as f:
                prompts += [line.rstrip("\n") for line in f if line.strip()]
        except OSError as exc:
            raise ConfigError(f"cannot read --prompts-file {args.prompts_file}: {exc.strerror}") from None
    if not prompts:
        raise ConfigError("no prompt given; pass --prompt TEXT or --prompts-file FILE")
    return prompts


def _cmd_generate(args: argparse.Namespace) -> int:
    from .llm import LLM
    from .sampling_params import SamplingParams

    from .errors import ConfigError
    from .sampling_params import StructuredOutputsParams

    prompts = _read_prompts(args)
    structured = None
    if args.json_schema:
        try:
            with open(args.json_schema) as f:
                structured = StructuredOutputsParams(json=f.read())
        except OSError as exc:
            raise ConfigError(f"cannot read --json-schema {args.json_schema}: {exc.strerror}") from None
    elif args.regex:
        structured = StructuredOutputsParams(regex=args.regex)
    params = SamplingParams(
        temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, max_tokens=args.max_tokens, seed=args.seed_request,
        structured_outputs=structured,
    )
    overrides = {
        "backend": args.backend, "kernels": args.kernels, "interpret": args.interpret or None, "dtype": args.dtype,
        "max_model_len": args.max_model_len, "kv_cache_memory": args.kv_cache_memory, "seed": args.seed,
        "enforce_eager": args.enforce_eager,
    }
    if args.stats or args.verbose:
        _log_to_stderr()
    llm = LLM(model=args.model, config=args.config, **overrides)
    failed = False
    if len(prompts) == 1:
        printed = 0
        for out in llm.generate_stream(prompts, params):
            if out.error:
                print(f"deepinfer: error: {out.error}", file=sys.stderr)
                return 2
            text = out.outputs[0].text
            sys.stdout.write(text[printed:])
            sys.stdout.flush()
            printed = len(text)
        sys.stdout.write("\n")
    else:
        outs = llm.generate(prompts, params, use_tqdm=sys.stderr.isatty() or args.progress)
        for i, out in enumerate(outs):
            print(f"=== [{i}] {out.prompt!r}")
            if out.error:
                failed = True
                print(f"error: {out.error}")
            else:
                print(out.outputs[0].text)
    if args.stats:
        print(llm.engine.stats_line(), file=sys.stderr)
    return 2 if failed else 0


def _log_to_stderr() -> None:
    """Start-up lines (the KV cache plan, graph capture) on stderr."""
    import logging

    log = logging.getLogger("deepinfer")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("deepinfer: %(message)s"))
    log.addHandler(handler)
    log.setLevel(logging.INFO)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="deepinfer", description="Offline DeepSeek-V4 inference on pluggable hardware backends")
    parser.add_argument("--config", default=None, help="YAML or JSON file of EngineConfig fields")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("backends", help="list every discovered backend plugin and whether it can run here")
    p.add_argument("--json", action="store_true", help="print a JSON list instead of a table")
    p.set_defaults(func=_cmd_backends)

    p = sub.add_parser("generate", help="generate text (with no --model, the bundled model)")
    p.add_argument("--model", default=None, help="HF-layout DeepSeek-V4 directory (default: the bundled model)")
    p.add_argument("--prompt", action="append", help="a prompt (repeatable)")
    p.add_argument("--prompts-file", help="a file with one prompt per line")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed-request", type=int, default=None, help="per-request sampling seed")
    p.add_argument("--seed", type=int, default=None, help="engine seed")
    p.add_argument("--backend", default=None)
    p.add_argument("--kernels", default=None)
    p.add_argument("--interpret", action="store_true", help="run Triton kernels on CPU tensors through Triton's interpreter")
    p.add_argument("--dtype", default=None, choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--kv-cache-memory", type=int, default=None, help="KV cache budget in bytes")
    p.add_argument("--json-schema", metavar="FILE", help="constrain the output to JSON matching this schema")
    p.add_argument("--regex", help="constrain the output to this regular expression")
    p.add_argument(
        "--enforce-eager", action=argparse.BooleanOptionalAction, default=None,
        help="never capture decode graphs (--no-enforce-eager: capture them even where the device does not by default)",
    )
    p.add_argument("--stats", action="store_true", help="print the start-up plan and the engine's statistics at the end")
    p.add_argument("--verbose", action="store_true", help="print the start-up plan (KV cache, graph capture)")
    p.add_argument("--progress", action="store_true", help="show a progress bar even when stderr is not a terminal")
    p.set_defaults(func=_cmd_generate)

    p = sub.add_parser("conformance", help="check a backend against the reference")
    from deepinfer_conformance.cli import add_arguments

    add_arguments(p)
    p.set_defaults(func=_cmd_conformance)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except DeepInferError as exc:
        print(f"deepinfer: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
