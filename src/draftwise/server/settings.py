"""Server settings (what ``draftwise serve`` flags control besides the models)."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ServerSettings", "DEFAULT_MAX_TOKENS"]

DEFAULT_MAX_TOKENS = 256


@dataclass(frozen=True)
class ServerSettings:
    """How the server answers requests.

    Attributes:
        served_model_names: names clients may put in ``model``; the first is reported in responses. Empty:
            the target's name (what the user passed on the command line).
        api_key: when set, ``/v1/*`` requests need ``Authorization: Bearer <api_key>`` (else 401).
        chat_template: a Jinja chat template used instead of the tokenizer's (needed for models that have
            none, such as base models).
        default_max_tokens: new tokens when a request does not set ``max_tokens``; clamped to the context
            room left by the prompt. One request occupies the engine at a time, so the default is bounded
            (OpenAI's own default is 16 for completions and "up to the context" for chat).
        max_waiting_requests: requests allowed to wait in the queue; beyond that a request gets 503.
        disconnect_poll_s: how often (seconds) a non-streaming request checks whether its client left.

    Raises:
        ValueError: out-of-range values.
    """

    served_model_names: tuple[str, ...] = ()
    api_key: str | None = None
    chat_template: str | None = None
    default_max_tokens: int = DEFAULT_MAX_TOKENS
    max_waiting_requests: int = 256
    disconnect_poll_s: float = 0.5

    def __post_init__(self) -> None:
        object.__setattr__(self, "served_model_names", tuple(self.served_model_names))
        if self.default_max_tokens < 1:
            raise ValueError(f"default_max_tokens must be >= 1, got {self.default_max_tokens}")
        if self.max_waiting_requests < 1:
            raise ValueError(f"max_waiting_requests must be >= 1, got {self.max_waiting_requests}")
        if not self.disconnect_poll_s > 0:
            raise ValueError(f"disconnect_poll_s must be > 0, got {self.disconnect_poll_s}")
        if self.api_key is not None and not self.api_key:
            raise ValueError("api_key must be non-empty when set")
