"""OpenAI response bodies and server-sent-event chunks for completions and chat completions."""

from __future__ import annotations

import json
import time

from draftwise.server.protocol import (
    ChatChoice,
    ChatCompletionResponse,
    ChatMessageOut,
    CompletionChoice,
    CompletionResponse,
    PromptTokensDetails,
    SpeculativeUsage,
    Usage,
)
from draftwise.stats import SpeculativeStats

__all__ = ["make_usage", "completion_body", "chat_body", "completion_chunk", "chat_chunk", "usage_chunk",
           "sse", "SSE_DONE"]

SSE_DONE = "data: [DONE]\n\n"


def make_usage(prompt_tokens: int, completion_tokens: int, stats: SpeculativeStats, method: str,
               num_speculative_tokens: int) -> Usage:
    """OpenAI usage plus the request's speculative statistics."""
    speculative = SpeculativeUsage(
        method=method,
        num_speculative_tokens=num_speculative_tokens,
        num_drafts=stats.num_drafts,
        num_draft_tokens=stats.num_draft_tokens,
        num_accepted_tokens=stats.num_accepted_tokens,
        acceptance_rate=stats.acceptance_rate,
        mean_accepted_length=stats.mean_accepted_length,
        acceptance_by_position=stats.acceptance_by_position,
        accepted_per_position=list(stats.accepted_per_position),
        drafted_per_position=list(stats.drafted_per_position),
        hybrid_steps=dict(stats.hybrid_steps) if stats.hybrid_steps is not None else None,
        jump_forward_tokens=stats.num_jump_forward_tokens,
        grammar_time_s=stats.processor_time_s,
    )
    return Usage(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                 total_tokens=prompt_tokens + completion_tokens,
                 prompt_tokens_details=PromptTokensDetails(cached_tokens=stats.num_cached_prompt_tokens),
                 speculative=speculative)


def completion_body(request_id: str, model: str, text: str, finish_reason: str, usage: Usage,
                    logprobs: dict | None = None, prompt_logprobs: list | None = None) -> dict:
    """A ``text_completion`` object (``logprobs`` / ``prompt_logprobs``: :mod:`draftwise.server.logprobs`)."""
    choice = CompletionChoice(text=text, finish_reason=finish_reason, logprobs=logprobs,
                              prompt_logprobs=prompt_logprobs)
    return CompletionResponse(id=request_id, created=int(time.time()), model=model, choices=[choice],
                              usage=usage).model_dump()


def chat_body(request_id: str, model: str, text: str | None, finish_reason: str, usage: Usage,
              tool_calls: list[dict] | None = None, logprobs: dict | None = None,
              prompt_logprobs: list | None = None) -> dict:
    """A ``chat.completion`` object (``text`` None: a reply of tool calls only; ``logprobs`` /
    ``prompt_logprobs``: :mod:`draftwise.server.logprobs`)."""
    message = ChatMessageOut(content=text, tool_calls=tool_calls or None)
    return ChatCompletionResponse(
        id=request_id, created=int(time.time()), model=model,
        choices=[ChatChoice(message=message, finish_reason=finish_reason, logprobs=logprobs)], usage=usage,
        prompt_logprobs=prompt_logprobs,
    ).model_dump()


def completion_chunk(request_id: str, created: int, model: str, text: str, finish_reason: str | None,
                     include_usage: bool, logprobs: dict | None = None, prompt_logprobs: list | None = None) -> dict:
    """A streamed ``text_completion`` chunk (``usage: null`` when the client asked for usage; ``logprobs``: its
    tokens'; ``prompt_logprobs``: on the first chunk of a request that asked for them)."""
    choice = {"index": 0, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
    if prompt_logprobs is not None:
        choice["prompt_logprobs"] = prompt_logprobs
    chunk = {"id": request_id, "object": "text_completion", "created": created, "model": model, "choices": [choice]}
    if include_usage:
        chunk["usage"] = None
    return chunk


def chat_chunk(request_id: str, created: int, model: str, delta: dict, finish_reason: str | None,
               include_usage: bool, logprobs: dict | None = None, prompt_logprobs: list | None = None) -> dict:
    """A ``chat.completion.chunk`` (``delta``: ``{"role": ...}``, ``{"content": ...}`` or ``{}``; ``logprobs``: its
    tokens'; ``prompt_logprobs``: on the first chunk of a request that asked for them)."""
    chunk = {"id": request_id, "object": "chat.completion.chunk", "created": created, "model": model,
             "choices": [{"index": 0, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}]}
    if prompt_logprobs is not None:
        chunk["prompt_logprobs"] = prompt_logprobs
    if include_usage:
        chunk["usage"] = None
    return chunk


def usage_chunk(request_id: str, created: int, model: str, object_name: str, usage: Usage) -> dict:
    """The last chunk of a stream with ``stream_options.include_usage``: empty choices, the usage."""
    return {"id": request_id, "object": object_name, "created": created, "model": model, "choices": [],
            "usage": usage.model_dump()}


def sse(payload: dict) -> str:
    """One server-sent event carrying a JSON payload."""
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"
