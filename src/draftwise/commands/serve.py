"""``draftwise serve [TARGET]``: the OpenAI-compatible server (flags named as in ``vllm serve``).

Without any model named it serves the demo pair (target + draft); with a target but no draft it serves plain
decoding. ``--speculative-model none`` forces plain decoding.
"""

from __future__ import annotations

import argparse
import logging
import os
import socket
from dataclasses import dataclass
from pathlib import Path

from draftwise.builder import DEMO_DRAFT, DEMO_TARGET, KV_CACHE_MEMORY_DEFAULT_HELP, KvCacheBudget, kv_cache_budget
from draftwise.commands.common import (
    CliError,
    add_backend_arg,
    add_model_args,
    add_quantization_arg,
    check_device_args,
    memory_size,
    speculative_config_from_args,
)
from draftwise.config import SpeculativeConfig
from draftwise.server.generation_config import GenerationConfigError, load_generation_defaults
from draftwise.server.settings import (
    DEFAULT_MAX_REQUEST_BYTES,
    DEFAULT_MAX_TOKENS,
    DEFAULT_SHUTDOWN_GRACE_S,
    ServerSettings,
)

__all__ = ["register", "run", "ServePlan", "plan_from_args"]

logger = logging.getLogger(__name__)

API_KEY_ENV = "DRAFTWISE_API_KEY"
DEFAULT_MAX_NUM_SEQS = 8
DEFAULT_MAX_NUM_BATCHED_TOKENS = 256


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "serve", help="OpenAI-compatible HTTP server with speculative decoding",
        description="Serve /v1/completions, /v1/chat/completions, /v1/models, /health and /metrics. "
        f"Default models: {DEMO_TARGET} with draft {DEMO_DRAFT}. See docs/server.md.")
    parser.add_argument("model_tag", nargs="?", default=None, metavar="TARGET",
                        help="target model: registry name, .gguf file, HF directory or hub id")
    parser.add_argument("--model", dest="model_flag", default=None, help="same as TARGET (vLLM's older flag)")
    add_model_args(parser)
    add_quantization_arg(parser)
    add_backend_arg(parser)
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1; 0.0.0.0 for all)")
    parser.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    parser.add_argument("--served-model-name", nargs="+", default=None,
                        help="name(s) clients use in 'model' (default: TARGET's base name without .gguf for a "
                        "local file or directory, else TARGET as given)")
    parser.add_argument("--api-key", default=None,
                        help=f"require 'Authorization: Bearer KEY' on /v1 (default: ${API_KEY_ENV}); an empty "
                        "key is an error")
    parser.add_argument("--chat-template", default=None,
                        help="Jinja chat template (a file or the template itself) for models without one")
    parser.add_argument("--default-max-tokens", type=int, default=DEFAULT_MAX_TOKENS,
                        help="max_tokens when a request sets none (default: the rest of the context window after "
                        "the prompt, as vLLM; a number is clamped to it)")
    parser.add_argument("--kv-cache-memory", type=memory_size, default=None, metavar="SIZE",
                        help="memory for the KV states of finished requests, reused by later requests that share a "
                        "token prefix with one (agent loops resend the conversation each turn), e.g. 4GiB, 512MB; "
                        f"0 turns prefix reuse off (default: {KV_CACHE_MEMORY_DEFAULT_HELP}; least recently used "
                        "evicted first)")
    parser.add_argument("--max-waiting-requests", type=int, default=256,
                        help="queued requests beyond which new ones get 503 (default 256)")
    parser.add_argument("--max-num-seqs", type=int, default=DEFAULT_MAX_NUM_SEQS,
                        help="requests decoded together by continuous batching (one KV-cache slot each; "
                        f"default {DEFAULT_MAX_NUM_SEQS}). Needs the lean runtime (int8 on the CPU) and plain "
                        "decoding or the ngram, suffix, draft_model or hybrid method; otherwise, or with 1, the server "
                        "runs one request at a time. With k_policy auto, K per request falls as the batch grows. "
                        "See docs/batching.md")
    parser.add_argument("--max-num-batched-tokens", type=int, default=DEFAULT_MAX_NUM_BATCHED_TOKENS,
                        help="continuous batching: rows per target pass (last tokens, draft tokens and prompt "
                        f"chunks; default {DEFAULT_MAX_NUM_BATCHED_TOKENS}): a long prompt is prefilled in chunks "
                        "so it does not stall the running requests")
    parser.add_argument("--max-request-bytes", type=int, default=DEFAULT_MAX_REQUEST_BYTES,
                        help=f"largest request body accepted, in bytes; larger ones get 413 (default "
                        f"{DEFAULT_MAX_REQUEST_BYTES}, 8 MiB)")
    parser.add_argument("--shutdown-grace-seconds", type=float, default=DEFAULT_SHUTDOWN_GRACE_S,
                        help="on SIGTERM/SIGINT, seconds the running request gets to finish; waiting requests "
                        f"get 503 at once (default {DEFAULT_SHUTDOWN_GRACE_S:g})")
    parser.add_argument("--enable-docs", action="store_true",
                        help="serve the OpenAPI schema and its viewers (/openapi.json, /docs, /redoc), behind "
                        "--api-key like /v1 when a key is set (default: off, those paths are 404s)")
    parser.add_argument("--tool-call-parser", default="auto", choices=["auto", "hermes", "llama3_json", "mistral", "none"],
                        help="the tool-call format of the model's replies, read into message.tool_calls (default auto: "
                        "detected from the chat template, e.g. hermes for Qwen2.5; none: requests with tools are "
                        "refused)")
    parser.add_argument("--generation-config", default="auto", metavar="auto|none|PATH",
                        help="sampling defaults (temperature, top_p, top_k, min_p, penalties, max_new_tokens as "
                        "max_tokens) for the fields a request does not send, from the model's "
                        "generation_config.json, as vLLM: auto (default) finds it beside the model (an HF "
                        "directory; next to a .gguf file as NAME.generation_config.json or generation_config.json; "
                        "the local hub cache), none uses OpenAI's defaults, PATH names a file or a directory")
    parser.add_argument("--uvicorn-log-level", default="info",
                        choices=["critical", "error", "warning", "info", "debug", "trace"])
    parser.set_defaults(func=run)


@dataclass(frozen=True)
class ServePlan:
    """What ``serve`` will load and how it will answer (resolved from the flags, nothing loaded yet)."""

    target: str
    speculative_config: SpeculativeConfig | None
    settings: ServerSettings
    kv_cache: KvCacheBudget


def plan_from_args(args: argparse.Namespace) -> ServePlan:
    """Resolve the target, the speculative config (demo draft by default), the server settings and the
    prefix-cache budget (``--kv-cache-memory``, else :func:`draftwise.builder.default_kv_cache_memory` of the
    memory available now).

    Raises:
        CliError: a device or dtype this machine lacks, conflicting targets, an unreadable chat template,
            out-of-range settings.
    """
    check_device_args(args)
    target = _target(args)
    if target is None:
        target = DEMO_TARGET
        if args.speculative_model is None and not args.speculative_config:
            args.speculative_model = DEMO_DRAFT
    spec = speculative_config_from_args(args)
    try:
        generation_defaults = load_generation_defaults(args.generation_config, target)
    except GenerationConfigError as exc:
        raise CliError(str(exc)) from exc
    try:
        settings = ServerSettings(
            served_model_names=tuple(args.served_model_name or ()),
            api_key=_api_key(args.api_key),
            chat_template=_chat_template(args.chat_template),
            default_max_tokens=args.default_max_tokens,
            max_waiting_requests=args.max_waiting_requests,
            max_request_bytes=args.max_request_bytes,
            shutdown_grace_s=args.shutdown_grace_seconds,
            enable_docs=args.enable_docs,
            tool_call_parser=None if args.tool_call_parser == "auto" else args.tool_call_parser,
            generation_defaults=generation_defaults,
        )
    except ValueError as exc:
        raise CliError(str(exc)) from exc
    if not 0 <= args.port <= 65535:
        raise CliError(f"--port must be in 0..65535, got {args.port}")
    if args.max_num_seqs < 1 or args.max_num_batched_tokens < 1:
        raise CliError(f"--max-num-seqs and --max-num-batched-tokens must be >= 1, got {args.max_num_seqs} and "
                       f"{args.max_num_batched_tokens}")
    return ServePlan(target=target, speculative_config=spec, settings=settings,
                     kv_cache=kv_cache_budget(args.kv_cache_memory))


def _target(args: argparse.Namespace) -> str | None:
    if args.model_tag and args.model_flag and args.model_tag != args.model_flag:
        raise CliError(f"two different targets given: {args.model_tag!r} and --model {args.model_flag!r}")
    return args.model_tag or args.model_flag


def _api_key(flag: str | None) -> str | None:
    """The key from ``--api-key`` or else ``$DRAFTWISE_API_KEY``; None when neither is set.

    Raises:
        CliError: the key given is empty or blank (it would silently serve without authentication).
    """
    source, key = ("--api-key", flag) if flag is not None else (f"${API_KEY_ENV}", os.environ.get(API_KEY_ENV))
    if key is not None and not key.strip():
        raise CliError(f"{source} is empty: give a non-blank key, or leave it unset to serve without "
                       "authentication")
    return key


def _chat_template(value: str | None) -> str | None:
    """A template file's contents, or the template itself when the value looks like Jinja; checked by
    :func:`_check_chat_template` before any model loads.

    Raises:
        CliError: neither a file nor Jinja, or a template that fails (see :func:`_check_chat_template`).
    """
    if value is None:
        return None
    path = Path(value)
    if path.is_file():
        template = path.read_text(encoding="utf-8")
    elif "{{" in value or "{%" in value:
        template = value
    else:
        raise CliError(f"--chat-template: no such file, and not a Jinja template: {value!r}")
    _check_chat_template(template)
    return template


def _check_chat_template(template: str) -> None:
    """Render ``template`` once, as transformers will for every chat request, on a one-message conversation: a
    template that does not parse, or fails on the simplest conversation, would otherwise answer every chat
    request with an error that blames the client.

    Raises:
        CliError: with the template's own error (Jinja's syntax and render errors, its ``raise_exception``).
    """
    from transformers.utils.chat_template_utils import render_jinja_template

    try:
        render_jinja_template([[{"role": "user", "content": "Hello"}]], chat_template=template,
                              add_generation_prompt=True)
    except Exception as error:  # noqa: BLE001 - whatever the template raises is the user's to see
        raise CliError(f"--chat-template fails on a one-message conversation: {type(error).__name__}: "
                       f"{error}") from error


def _check_port_free(host: str, port: int) -> None:
    """Bind ``host:port`` once and let go, before any model loads (a taken port was found only after loading,
    a minute for the Qwen pair). uvicorn binds again with SO_REUSEADDR, as this does.

    Raises:
        CliError: the address does not resolve or cannot be bound (in use, not this machine's, no permission).
    """
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        with socket.socket(family, kind, proto) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(address)
    except OSError as error:
        raise CliError(f"cannot listen on {host}:{port}: {error.strerror or error}") from None


def run(args: argparse.Namespace) -> int:
    """Load the models, then serve until interrupted."""
    from draftwise.builder import build_engine
    from draftwise.server import create_app, serve

    plan = plan_from_args(args)
    _check_port_free(args.host, args.port)
    _enable_request_logging()
    logger.info("%s", plan.kv_cache.describe())
    logger.info("%s", plan.settings.generation_defaults.describe())
    logger.info("loading %s (%s)", plan.target,
                f"draft {plan.speculative_config.model or plan.speculative_config.method}, "
                f"K={plan.speculative_config.num_speculative_tokens}" if plan.speculative_config else "plain decoding")
    bundle = build_engine(plan.target, plan.speculative_config, device=args.device, dtype=args.dtype,
                          max_context=args.max_model_len, quantization=args.quantization,
                          backend=args.backend, threads=args.threads, kv_cache_memory=plan.kv_cache.nbytes,
                          runtime=args.runtime, max_num_seqs=args.max_num_seqs,
                          max_num_batched_tokens=args.max_num_batched_tokens)
    app = create_app(bundle, plan.settings)
    logger.info("OpenAI-compatible API at http://%s:%d/v1", args.host, args.port)
    serve(app, host=args.host, port=args.port, log_level=args.uvicorn_log_level)
    return 0


def _enable_request_logging() -> None:
    """Show the server's INFO lines (startup, one line per request, the compute threads following the machine's
    load) even without ``-v``."""
    server_logger = logging.getLogger("draftwise")
    if server_logger.getEffectiveLevel() > logging.INFO:
        for name in ("draftwise.server", "draftwise.cpu_share", __name__):
            logging.getLogger(name).setLevel(logging.INFO)
