"""OpenAI request and response schemas (the subset draftwise serves), as pydantic models.

Requests are validated strictly (a string where a number belongs is a 400, not a silent conversion); fields
this server does not know are accepted and ignored, as vLLM does. Fields it knows but cannot honour
(penalties...) are rejected with a 400 by :mod:`draftwise.server.validation`.

vLLM's extra sampling fields ``top_k``, ``ignore_eos`` and ``stop_token_ids`` are accepted too (pass them
with the OpenAI client's ``extra_body``), and draftwise's ``sampling`` (``"coupled"`` or ``"rejection"``).

Every string field is :data:`Text`: valid Unicode, so a lone UTF-16 surrogate (JSON ``"\\ud800"`` without
its pair) is a 400 naming the field, before it can reach a tokenizer or an error message.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

__all__ = [
    "Text", "StreamOptions", "CompletionRequest", "ChatMessage", "ContentPart", "ChatCompletionRequest",
    "SpeculativeUsage", "Usage", "CompletionChoice", "CompletionResponse", "ChatMessageOut", "ChatChoice",
    "ChatCompletionResponse", "ModelCard", "ModelList",
]


def _valid_unicode(value: str) -> str:
    """Refuse strings UTF-8 cannot encode (lone surrogates, which JSON's ``\\uXXXX`` escapes can produce)."""
    if value.isascii():
        return value
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"the text holds a lone UTF-16 surrogate ({value[exc.start]!r} at index {exc.start}) "
                         "and is not valid Unicode: send characters, or surrogate pairs, only") from None
    return value


Text = Annotated[str, AfterValidator(_valid_unicode)]
"""A request string: any valid Unicode text (a lone surrogate is a validation error, so a 400)."""


class _Request(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")


class StreamOptions(_Request):
    """``stream_options``: ``include_usage`` adds a last chunk with the usage (and empty ``choices``)."""

    include_usage: bool = False


class _SamplingFields(_Request):
    """Fields shared by both endpoints."""

    model: Text | None = None
    max_tokens: int | None = None
    temperature: float | None = None  # OpenAI's default: 1.0
    top_p: float | None = None
    n: int | None = None  # null or absent: 1 (OpenAI's default)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: Text | list[Text] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[Text, float] | None = None
    user: Text | None = None
    # vLLM extras
    top_k: int | None = None
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    min_tokens: int | None = None
    repetition_penalty: float | None = None
    min_p: float | None = None
    # draftwise extra: "coupled" or "rejection" (unset: coupled with a seed); validated in validation.py
    sampling: str | None = None
    # draftwise extra: this request's K, 0..the server's K (0: plain decoding); unset: the server's policy
    num_speculative_tokens: int | None = None
    # vLLM extra: each prompt token's logprob and this many alternatives (0..20)
    prompt_logprobs: int | None = None


class CompletionRequest(_SamplingFields):
    """``POST /v1/completions``. ``prompt``: a string, a list of token ids, or a list of one of either;
    ``suffix``: the text after the cursor (fill-in-the-middle, :mod:`draftwise.server.fim`); ``echo``: the prompt's
    text before each choice's (with ``logprobs``, its tokens' logprobs first); ``best_of``: choices generated, of
    which the ``n`` with the highest cumulative logprob are returned."""

    prompt: Text | list[int] | list[Text] | list[list[int]]
    echo: bool = False
    logprobs: int | None = None
    best_of: int | None = None
    suffix: Text | None = None


class ContentPart(_Request):
    """One part of a message's content; only ``{"type": "text", "text": ...}`` is served."""

    type: Text
    text: Text | None = None


class ChatMessage(_Request):
    """One chat message. ``developer`` is treated as ``system``."""

    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: Text | list[ContentPart] | None = None
    name: Text | None = None
    tool_calls: list[Any] | None = None  # an assistant turn's calls (arguments as JSON strings)
    tool_call_id: Text | None = None  # a tool result's call
    function_call: Any = None  # legacy assistant call


class ChatCompletionRequest(_SamplingFields):
    """``POST /v1/chat/completions``. ``max_completion_tokens`` wins over ``max_tokens``."""

    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    functions: list[Any] | None = None
    function_call: Any = None
    response_format: dict[str, Any] | None = None


# ---------------------------------------------------------------------- responses
class _Response(BaseModel):
    model_config = ConfigDict(extra="forbid")


class SpeculativeUsage(_Response):
    """The request's speculative decoding statistics (a draftwise extension of ``usage``).

    ``acceptance_rate`` = accepted / draft tokens (None when nothing was drafted); ``mean_accepted_length``
    = 1 + accepted / target verification passes (1.0 for plain decoding); ``acceptance_by_position[i]`` = the
    fraction of drafts whose token at position i was accepted; ``hybrid_steps`` = the ``hybrid`` method's
    verification passes by the side that drafted them (``suffix``, ``draft_model``, ``plain``: none), None for
    other methods; ``jump_forward_tokens`` = tokens the request's grammar forced, drafted for free and accepted
    (not in the draft counts); ``grammar_time_s`` = seconds its logits processors (grammar, penalties, ``logit_bias``,
    ``min_tokens``) took on the target's rows.
    """

    method: str
    num_speculative_tokens: int
    num_drafts: int
    num_draft_tokens: int
    num_accepted_tokens: int
    acceptance_rate: float | None
    mean_accepted_length: float
    acceptance_by_position: list[float]
    accepted_per_position: list[int]
    drafted_per_position: list[int]
    hybrid_steps: dict[str, int] | None = None
    jump_forward_tokens: int = 0
    grammar_time_s: float = 0.0


class PromptTokensDetails(_Response):
    """OpenAI's ``usage.prompt_tokens_details``: ``cached_tokens`` = prompt tokens whose KV state came from
    the prefix cache (not prefilled)."""

    cached_tokens: int


class Usage(_Response):
    """OpenAI's usage plus ``speculative``."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails
    speculative: SpeculativeUsage


class CompletionChoice(_Response):
    """One completion; ``logprobs``: OpenAI's legacy object (``tokens``, ``token_logprobs``, ``top_logprobs``,
    ``text_offset``) when asked for; ``prompt_logprobs``: vLLM's, when asked for (:mod:`draftwise.server.logprobs`)."""

    index: int = 0
    text: str
    logprobs: dict[str, Any] | None = None
    finish_reason: str | None = None
    prompt_logprobs: list[dict[str, dict[str, Any]] | None] | None = None


class CompletionResponse(_Response):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None


class ChatMessageOut(_Response):
    """The assistant's reply: ``content`` (None when the reply is only tool calls) and its ``tool_calls``
    (``[{"id", "type": "function", "function": {"name", "arguments": JSON string}}]``) when it made any."""

    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[dict[str, Any]] | None = None


class ChatChoice(_Response):
    """One reply; ``logprobs``: ``{"content": [...], "refusal": null}`` when asked for
    (:mod:`draftwise.server.logprobs`)."""

    index: int = 0
    message: ChatMessageOut
    logprobs: dict[str, Any] | None = None
    finish_reason: str | None = None


class ChatCompletionResponse(_Response):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    system_fingerprint: str | None = None
    prompt_logprobs: list[dict[str, dict[str, Any]] | None] | None = None  # vLLM's, when asked for


class ModelCard(_Response):
    """One entry of ``GET /v1/models`` (``max_model_len`` as vLLM reports it)."""

    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "draftwise"
    root: str
    max_model_len: int
    speculative_method: str = Field(description="'plain' or the speculative method")


class ModelList(_Response):
    object: Literal["list"] = "list"
    data: list[ModelCard]
