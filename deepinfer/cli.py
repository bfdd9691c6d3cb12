"""The ``deepinfer`` command line: ``backends``, ``conformance``, ``generate``, ``inspect``.

User errors print one line and exit with status 2, never a traceback. A
closed pipe (``deepinfer backends --json | head -1``) ends quietly with the
conventional SIGPIPE status, 141.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from .config import load_config
from .engine_flags import add_engine_arguments, engine_overrides
from .errors import ConfigError, DeepInferError


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
            print(f"{'':<10} parts: {parts}; interface {s.interface_version} (deepinfer {s.as_dict()['engine_interface_version']}); package {s.package}")
            print(f"{'':<10} own kernels: {', '.join(s.overrides) if s.overrides else 'none (reference everywhere)'}")
            if s.routed_to_reference:
                print(f"{'':<10} newer features on the reference: {', '.join(s.routed_to_reference)}")
            kernel_set = kernel_sets.get(s.parts["kernels"])
            paths = getattr(kernel_set.obj, "paths", None) if kernel_set else None
            if callable(paths):  # a kernel set that says how each op runs (e.g. torch_npu fused op or Triton)
                print(f"{'':<10} kernel paths: {', '.join(f'{op}={how}' for op, how in paths().items())}")
    return 0


def _cmd_conformance(args: argparse.Namespace) -> int:
    from deepinfer_conformance.cli import run

    cfg = load_config({"backend": args.backend, "kernels": args.kernels, "interpret": args.interpret or None}, args.config)
    return run(args, cfg.backend, cfg.interpret)


def _read_prompts(args: argparse.Namespace, required: bool = True) -> list[str]:
    from .errors import ConfigError

    prompts = list(args.prompt or [])
    if args.prompts_file:
        try:
            with open(args.prompts_file) as f:
                prompts += [line.rstrip("\n") for line in f if line.strip()]
        except OSError as exc:
            raise ConfigError(f"cannot read --prompts-file {args.prompts_file}: {exc.strerror}") from None
    if not prompts and required:
        raise ConfigError("no prompt given; pass --prompt TEXT or --prompts-file FILE")
    return prompts


def _read_conversations(args: argparse.Namespace, prompts: list[str]) -> list[tuple[str, list[dict]]]:
    """``--chat``: (label, conversation) pairs — those of ``--messages FILE``, then one user turn per prompt
    (after ``--system``). The file's messages are checked here, before the model loads."""
    from .chat import parse_conversation
    from .chat.messages import is_single_conversation
    from .errors import ChatFormatError, ConfigError

    conversations: list[list[dict]] = []
    if args.messages:
        try:
            with open(args.messages, encoding="utf-8") as f:
                data = json.load(f)
        except OSError as exc:
            raise ConfigError(f"cannot read --messages {args.messages}: {exc.strerror}") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            detail = f"{exc.msg} at line {exc.lineno} column {exc.colno}" if isinstance(exc, json.JSONDecodeError) else str(exc)
            raise ConfigError(f"--messages {args.messages} is not valid JSON ({detail})") from None
        file_convs = [data] if is_single_conversation(data) else data
        if not isinstance(file_convs, list) or not file_convs:
            raise ConfigError(f"--messages {args.messages} must hold a list of messages or a list of conversations")
        for k, conv in enumerate(file_convs):
            try:
                parse_conversation(conv)
            except ChatFormatError as exc:
                where = f"conversation {k}: " if len(file_convs) > 1 else ""
                raise ChatFormatError(f"--messages {args.messages}: {where}{exc}") from None
            conversations.append(conv)
    system = [{"role": "system", "content": args.system}] if args.system is not None else []
    conversations += [[*system, {"role": "user", "content": p}] for p in prompts]
    labels = []
    for k, conv in enumerate(conversations):
        users = [m.get("content") for m in conv if m.get("role") == "user" and isinstance(m.get("content"), str)]
        labels.append(users[-1] if users else f"conversation {k}")
    return list(zip(labels, conversations))


def _cmd_generate(args: argparse.Namespace) -> int:
    from .llm import LLM
    from .sampling_params import SamplingParams

    from .errors import ConfigError
    from .sampling_params import StructuredOutputsParams

    chat = args.chat or args.messages is not None
    if not chat and (args.thinking or args.system is not None or args.chat_template):
        raise ConfigError("--thinking, --system and --chat-template format a conversation; add --chat")
    template = None
    if args.chat_template:
        try:
            with open(args.chat_template, encoding="utf-8") as f:
                template = f.read()
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"cannot read --chat-template {args.chat_template}: {getattr(exc, 'strerror', None) or exc}") from None
    prompts = _read_prompts(args, required=not args.messages)
    conversations = _read_conversations(args, prompts) if chat else []
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
        structured_outputs=structured, cache_class=args.cache_class,
    )
    if args.stats or args.verbose:
        _log_to_stderr()
    # a flag left out is no keyword: the config file, the environment or the default decides
    llm = LLM(model=args.model, config=args.config, **engine_overrides(args))
    labels: list[str] = prompts
    inputs: list[str] | list[list[int]] = prompts
    if chat:
        labels = [label for label, _ in conversations]
        chat_prompts = llm.format_chat([c for _, c in conversations], chat_template=template, thinking=args.thinking)
        inputs = [p.token_ids for p in chat_prompts]
    failed = False
    if len(inputs) == 1:
        printed = 0
        for out in llm.generate_stream(inputs, params):
            if out.error:
                print(f"deepinfer: error: {out.error}", file=sys.stderr)
                return 2
            text = out.outputs[0].text
            sys.stdout.write(text[printed:])
            sys.stdout.flush()
            printed = len(text)
        sys.stdout.write("\n")
    else:
        outs = llm.generate(inputs, params, use_tqdm=sys.stderr.isatty() or args.progress)
        for i, out in enumerate(outs):
            print(f"=== [{i}] {labels[i]!r}")
            if out.error:
                failed = True
                print(f"error: {out.error}")
            else:
                print(out.outputs[0].text)
    if args.stats:
        print(llm.engine.stats_line(), file=sys.stderr)
    return 2 if failed else 0


def _cmd_serve(args: argparse.Namespace) -> int:
    import logging

    from .serve.engine_launch import launch_engine

    _log_to_stderr()
    config = load_config({"model": args.model, **engine_overrides(args)}, args.config)
    if args.max_queued_requests < 1 or args.shutdown_timeout < 0 or args.max_request_bytes < 1:
        raise ConfigError("--max-queued-requests and --max-request-bytes must be at least 1, --shutdown-timeout at least 0")
    launched = None
    if args.disaggregation_mode == "both" and int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        # the engine process starts loading now, beside this process's imports of the server (torch, the web stack)
        launched = launch_engine(config.model_dump_json(), logging.getLogger("deepinfer").isEnabledFor(logging.INFO))
    from .serve.server import ServeOptions, api_key_from_env, serve

    options = ServeOptions(
        host=args.host, port=args.port, advertise_host=args.advertise_host, api_key=api_key_from_env(args.api_key), served_model_names=args.served_model_name,
        chat_template=args.chat_template, max_queued_requests=args.max_queued_requests, shutdown_timeout=args.shutdown_timeout,
        max_request_bytes=args.max_request_bytes, reasoning_parser=args.reasoning_parser != "none",
        tool_call_parser=None if args.tool_call_parser == "none" else args.tool_call_parser, access_log=args.access_log,
        disaggregation_mode=args.disaggregation_mode, kv_connector=args.kv_connector,
        disaggregation_bootstrap_port=args.disaggregation_bootstrap_port, kv_transfer_timeout=args.kv_transfer_timeout,
        kv_load_failure_policy=args.kv_load_failure_policy, docs=not args.disable_docs,
    )
    return serve(config, options, launched)


def _size(n: int) -> str:
    """Bytes in the largest decimal unit that keeps a leading digit."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= scale:
            return f"{n / scale:,.2f} {unit}"
    return f"{n} B"


def _cmd_inspect(args: argparse.Namespace) -> int:
    import torch

    from .engine import resolve_model_dir
    from .kv_memory import kv_memory
    from .loader.files import model_directory, read_config
    from .models.registry import parse_config
    from .weight_memory import weight_memory

    dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}[args.dtype]
    directory = resolve_model_dir(args.model)
    mem = weight_memory(directory, ep=args.ep, dtype=dtype, quantization=args.quantization)
    kv = kv_memory(parse_config(read_config(model_directory(directory))), args.kv_cache_dtype, dtype)
    if args.json:
        print(json.dumps({**mem.as_dict(), "kv_bytes_per_token": kv.as_dict()}))
        return 0
    print(f"weights ({mem.quantization}, the rest in {mem.dtype}; built on the meta device as the engine holds them):")
    print(f"  {'part':<18} {'total':>12} {f'rank at --ep {mem.ep}':>16}")
    notes = {"backbone": "routed experts split, the rest on every rank", "engram": "n-gram tables, on every rank",
             "draft": "DSpark; its experts split"}
    for name, part in mem.parts.items():
        print(f"  {name:<18} {_size(part.total_bytes):>12} {_size(part.per_rank_bytes):>16}  ({notes.get(name, 'on every rank')})")
    print(f"  {'total':<18} {_size(mem.total_bytes):>12} {_size(mem.per_rank_bytes):>16}")
    for kind, n in mem.by_kind.items():
        print(f"  {kind:<18} {_size(n):>12}")
    print(f"one routed expert: {mem.bytes_per_routed_expert:,} B")
    if mem.checkpoint_bytes is not None:
        print(f"checkpoint on disk (index total_size, every stored tensor): {_size(mem.checkpoint_bytes)}")
    _print_kv(kv)
    return 0


def _print_kv(kv) -> None:
    """``inspect``'s KV cache lines: compressed state per token by kind, then the window rows apart."""
    print(f"KV cache (--kv-cache-dtype {kv.kv_cache_dtype} -> {kv.storage}; model dtype {kv.dtype}; blocks of {kv.block_size} tokens):")
    print(f"  compressed state per token of context: {kv.total:,.2f} B")
    for kind, n in kv.by_kind.items():
        if n:
            print(f"    {kind:<32} {n:>12,.2f} B")
    w = kv.window
    print(f"  window rows, kept per sequence whatever its length: {w.bytes_per_row:,} B per token row over all layers")
    for kind, n in w.bytes_per_row_by_kind.items():
        print(f"    {kind:<32} {n:>12,} B")
    print(f"  per sequence slot: {_size(w.bytes_per_slot)} of window rings ({w.rows_per_slot} rows a layer, steps of {w.step_tokens} tokens), "
          f"{_size(kv.ring_bytes_per_slot)} with the compressor states")


def _log_to_stderr() -> None:
    """Start-up lines (the KV cache plan, graph capture) on stderr."""
    import logging

    log = logging.getLogger("deepinfer")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("deepinfer: %(message)s"))
    log.addHandler(handler)
    log.setLevel(logging.INFO)


def _chosen_command(argv: list[str]) -> str | None:
    """The subcommand ``argv`` names (None when it names none): the first word after the global options."""
    words = iter(argv)
    for word in words:
        if word == "--config":
            next(words, None)
        elif not word.startswith("-"):
            return word
    return None


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The command line; ``command`` given, the subcommands that import torch to state their options
    (``kv-store``, ``conformance``) state them only when chosen, so ``serve`` starts its engine process
    before this process pays for torch."""
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
    p.add_argument("--chat", action="store_true", help="format each prompt as a user turn with the model's chat format")
    p.add_argument("--system", metavar="TEXT", help="with --chat: a system message before each prompt")
    p.add_argument(
        "--messages", metavar="FILE",
        help="a JSON file of messages (one conversation) or of conversations, each generated with the chat format (implies --chat)",
    )
    p.add_argument("--thinking", action="store_true", help="with --chat: open the reply in thinking mode (<think>)")
    p.add_argument("--chat-template", metavar="FILE", help="with --chat: a Jinja chat template to use instead of the model's format")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed-request", type=int, default=None, help="per-request sampling seed")
    add_engine_arguments(p)
    p.add_argument("--cache-class", metavar="NAME", default=None, help="with --kv-store: the retention class these prompts' blocks are kept under")
    p.add_argument("--json-schema", metavar="FILE", help="constrain the output to JSON matching this schema")
    p.add_argument("--regex", help="constrain the output to this regular expression")
    p.add_argument("--stats", action="store_true", help="print the start-up plan and the engine's statistics at the end")
    p.add_argument("--verbose", action="store_true", help="print the start-up plan (KV cache, graph capture)")
    p.add_argument("--progress", action="store_true", help="show a progress bar even when stderr is not a terminal")
    p.set_defaults(func=_cmd_generate)

    p = sub.add_parser("serve", help="serve the model over HTTP, OpenAI-compatible (with no --model, the bundled model)")
    p.add_argument("--model", default=None, help="HF-layout DeepSeek-V4 directory (default: the bundled model)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--advertise-host", default=None, metavar="ADDRESS",
                   help="the address of this machine peers are told to reach it at (KV transfers, the bootstrap answer); "
                        "default: --host when it is one address, else the interface that routes to them")
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on every endpoint but /health and /metrics (default: DEEPINFER_API_KEY)")
    p.add_argument("--served-model-name", nargs="+", default=None, metavar="NAME", help="the model's names in the API (the first is reported; default: --model)")
    p.add_argument("--chat-template", metavar="FILE", help="a Jinja chat template to use instead of the model's chat format")
    p.add_argument("--max-queued-requests", type=int, default=1024, help="completions (n per request) waiting to be scheduled past which new requests get 503")
    p.add_argument("--shutdown-timeout", type=float, default=30.0, help="seconds SIGTERM waits for requests in flight before aborting them")
    p.add_argument("--max-request-bytes", type=int, default=32 << 20, help="largest request body accepted (413 past it)")
    p.add_argument("--reasoning-parser", default="deepseek_v4", choices=["deepseek_v4", "none"],
                   help="split <think>...</think> into reasoning_content (none: leave it in content)")
    p.add_argument("--tool-call-parser", default="auto",
                   help="tool-call format parsed from replies when tools are declared: auto (the chat format's), deepseek_v4 (DSML), hermes (<tool_call> JSON), or none")
    p.add_argument("--access-log", action="store_true", help="log every HTTP request")
    p.add_argument("--disable-docs", action="store_true", help="do not serve the API's schema (/openapi.json) and its pages (/docs)")
    p.add_argument("--disaggregation-mode", default="both", choices=["both", "prefill", "decode"],
                   help="both (default): prefill and decode here; prefill: compute prompts and hand their KV over; decode: take it and generate")
    p.add_argument("--kv-connector", default="mooncake", help="how prefill and decode servers move KV state: mooncake (default) or store (through --kv-store DIR)")
    p.add_argument("--disaggregation-bootstrap-port", type=int, default=8998, help="prefill server: where decode servers meet it (SGLang's router)")
    p.add_argument("--kv-transfer-timeout", type=float, default=60.0, help="prefill server: seconds a handed-over KV state waits for its decode server; decode server: seconds a fetch of one may take")
    p.add_argument("--kv-load-failure-policy", default="fail", choices=["fail", "recompute"],
                   help="decode server, when a KV transfer fails: fail the request (default) or compute its prompt here")
    add_engine_arguments(p)
    p.set_defaults(func=_cmd_serve)

    p = sub.add_parser("inspect", help="the memory a checkpoint's weights and KV cache will take, from config.json and the index alone")
    p.add_argument("--model", default=None, help="HF-layout DeepSeek-V4 (or V4.1) directory; only config.json and the index are read")
    p.add_argument("--ep", type=int, default=1, help="expert-parallel degree: also give the largest rank's share")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"], help="dtype of the unquantized weights")
    p.add_argument("--quantization", default="auto", choices=["auto", "dequantize"])
    p.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8", "model"],
                   help="how the KV cache stores rows, for its bytes per token (as the engine's --kv-cache-dtype)")
    p.add_argument("--json", action="store_true",
                   help="print one JSON object (total_bytes, per_rank_bytes, by_kind, ep, kv_bytes_per_token, ...)")
    p.set_defaults(func=_cmd_inspect)

    p = sub.add_parser("kv-store", help="what a KV store directory holds (stats), and trimming it by retention class (prune)")
    if command in (None, "kv-store"):
        from .kv_store.cli import add_arguments as add_store_arguments

        add_store_arguments(p)

    p = sub.add_parser("conformance", help="check a backend against the reference")
    if command in (None, "conformance"):
        from deepinfer_conformance.cli import add_arguments

        add_arguments(p)
    p.set_defaults(func=_cmd_conformance)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser(_chosen_command(sys.argv[1:] if argv is None else argv))
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except DeepInferError as exc:
        print(f"deepinfer: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        return _closed_pipe()


#: exit status of a command whose output pipe closed (128 + SIGPIPE), as the shell reports it
CLOSED_PIPE_STATUS = 141


def _closed_pipe() -> int:
    """The reader of stdout went away: point stdout at devnull so the interpreter's final flush stays quiet."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    return CLOSED_PIPE_STATUS


if __name__ == "__main__":
    sys.exit(main())
