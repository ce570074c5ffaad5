"""Server settings (what ``draftwise serve`` flags control besides the models) and the served model's public
name (:func:`public_model_name`)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

from draftwise.server.generation_config import GenerationDefaults

__all__ = ["ServerSettings", "public_model_name", "DEFAULT_MAX_TOKENS", "DEFAULT_MAX_REQUEST_BYTES",
           "DEFAULT_SHUTDOWN_GRACE_S", "DEFAULT_TOKENIZER_COPIES"]

DEFAULT_MAX_TOKENS: int | None = None  # the rest of the context window, as vLLM's chat endpoint
DEFAULT_MAX_REQUEST_BYTES = 8 * 1024 * 1024  # 8 MiB: far above any context's worth of text or token ids
DEFAULT_SHUTDOWN_GRACE_S = 10.0
DEFAULT_TOKENIZER_COPIES = 4


def public_model_name(spec: str) -> str:
    """The name a server reports for a target given as ``spec`` when no served name is set: never a path.

    A local file or directory (an existing path, an absolute or ``~``/``.`` path, or any name ending in
    ``.gguf``) gives its base name without the ``.gguf`` extension (``/models/qwen/q.Q4_K_M.gguf`` ->
    ``q.Q4_K_M``; ``./llama/`` -> ``llama``); a registry name or hub id (``qwen2.5-coder-1.5b``,
    ``Qwen/Qwen2.5-0.5B``) is kept as given.
    """
    path = Path(spec).expanduser()
    looks_local = (spec.startswith(("/", "~", ".")) or path.is_absolute() or spec.lower().endswith(".gguf")
                   or path.exists())
    if not looks_local:
        return spec
    name = path.name
    if name.lower().endswith(".gguf"):
        name = name[: -len(".gguf")]
    return name or "model"


@dataclass(frozen=True)
class ServerSettings:
    """How the server answers requests.

    Attributes:
        served_model_names: names clients may put in ``model``; the first is reported in responses. Empty:
            the target's public name (:func:`public_model_name`: a local file's or
            directory's base name, never a path).
        api_key: when set, ``/v1/*`` requests need ``Authorization: Bearer <api_key>`` (scheme matched
            case-insensitively, else 401). Must not be empty or blank.
        chat_template: a Jinja chat template used instead of the tokenizer's (needed for models that have
            none, such as base models).
        default_max_tokens: new tokens when a request sets no ``max_tokens`` (``max_completion_tokens``,
            ``max_output_tokens``); None (the default): the rest of the context window after the prompt, as
            vLLM does, so an agent's long reply is not cut; a number is clamped to that room.
        max_waiting_requests: requests allowed to wait in the queue (cancelled ones do not count); beyond
            that a request gets 503.
        disconnect_poll_s: how often (seconds) a non-streaming request checks whether its client left.
        max_request_bytes: largest request body accepted, in bytes; a larger one gets 413 before it is parsed
            (checked on ``Content-Length`` and on the bytes actually received).
        shutdown_grace_s: seconds the running request gets to finish once shutdown starts (SIGTERM); waiting
            requests get 503 ``server_closing`` at once. 0: stop the running request at once.
        tokenizer_copies: private tokenizer copies for request tokenization (requests tokenize in parallel
            on up to this many copies; the engine thread has its own copy and never waits for them).
        tool_call_parser: the tool-call format of the model's replies (``hermes``, ``llama3_json``,
            ``mistral``: :data:`draftwise.server.tool_parsers.TOOL_PARSERS`); None: detected from the chat
            template (:func:`~draftwise.server.tool_parsers.detect_tool_parser`); ``"none"``: tools refused.
        enable_docs: serve the OpenAPI schema and its viewers (``/openapi.json``, ``/docs``, ``/redoc``),
            behind the API key like ``/v1`` when one is set. Off: those paths are 404s.
        generation_defaults: sampling defaults (the model's ``generation_config.json``, ``serve
            --generation-config``) applied to the fields a request does not send, before validation; empty:
            OpenAI's defaults.

    Raises:
        ValueError: out-of-range values.
    """

    served_model_names: tuple[str, ...] = ()
    api_key: str | None = None
    chat_template: str | None = None
    default_max_tokens: int | None = DEFAULT_MAX_TOKENS
    max_waiting_requests: int = 256
    disconnect_poll_s: float = 0.5
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    shutdown_grace_s: float = DEFAULT_SHUTDOWN_GRACE_S
    tokenizer_copies: int = DEFAULT_TOKENIZER_COPIES
    enable_docs: bool = False
    tool_call_parser: str | None = None
    generation_defaults: GenerationDefaults = field(default_factory=GenerationDefaults)

    def __post_init__(self) -> None:
        object.__setattr__(self, "served_model_names", tuple(self.served_model_names))
        if any(not name or not name.strip() for name in self.served_model_names):
            raise ValueError("served model names must be non-empty")
        if self.default_max_tokens is not None and self.default_max_tokens < 1:
            raise ValueError(f"default_max_tokens must be >= 1, got {self.default_max_tokens}")
        if self.max_waiting_requests < 1:
            raise ValueError(f"max_waiting_requests must be >= 1, got {self.max_waiting_requests}")
        if not self.disconnect_poll_s > 0:
            raise ValueError(f"disconnect_poll_s must be > 0, got {self.disconnect_poll_s}")
        if self.api_key is not None and not self.api_key.strip():
            raise ValueError("the API key is empty: give a non-blank key, or none to serve without authentication")
        if self.api_key is not None and self.api_key != self.api_key.strip():
            raise ValueError("the API key starts or ends with whitespace, which an Authorization header cannot carry")
        if self.max_request_bytes < 1024:
            raise ValueError(f"max_request_bytes must be >= 1024, got {self.max_request_bytes}")
        if not (math.isfinite(self.shutdown_grace_s) and self.shutdown_grace_s >= 0):
            raise ValueError(f"shutdown_grace_s must be a finite number >= 0, got {self.shutdown_grace_s}")
        if self.tokenizer_copies < 1:
            raise ValueError(f"tokenizer_copies must be >= 1, got {self.tokenizer_copies}")
