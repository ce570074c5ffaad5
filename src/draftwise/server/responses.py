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

__all__ = ["make_usage", "completion_choice", "chat_choice", "completion_body", "chat_body", "completion_chunk",
           "chat_chunk", "usage_chunk", "sse", "SSE_DONE"]

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


def completion_choice(index: int, text: str, finish_reason: str, logprobs: dict | None = None,
                      prompt_logprobs: list | None = None) -> CompletionChoice:
    """One choice of a ``text_completion`` object (``logprobs`` / ``prompt_logprobs``:
    :mod:`draftwise.server.logprobs`)."""
    return CompletionChoice(index=index, text=text, finish_reason=finish_reason, logprobs=logprobs,
                            prompt_logprobs=prompt_logprobs)


def chat_choice(index: int, text: str | None, finish_reason: str, tool_calls: list[dict] | None = None,
                logprobs: dict | None = None) -> ChatChoice:
    """One choice of a ``chat.completion`` object (``text`` None: a reply of tool calls only; ``logprobs``:
    :mod:`draftwise.server.logprobs`)."""
    message = ChatMessageOut(content=text, tool_calls=tool_calls or None)
    return ChatChoice(index=index, message=message, finish_reason=finish_reason, logprobs=logprobs)


def completion_body(request_id: str, model: str, choices: list[CompletionChoice], usage: Usage) -> dict:
    """A ``text_completion`` object (``choices`` in index order; usage over all of them)."""
    return CompletionResponse(id=request_id, created=int(time.time()), model=model, choices=choices,
                              usage=usage).model_dump()


def chat_body(request_id: str, model: str, choices: list[ChatChoice], usage: Usage,
              prompt_logprobs: list | None = None) -> dict:
    """A ``chat.completion`` object (``choices`` in index order; usage over all of them; ``prompt_logprobs``:
    vLLM's, once for the request's prompt, :mod:`draftwise.server.logprobs`)."""
    return ChatCompletionResponse(id=request_id, created=int(time.time()), model=model, choices=choices,
                                  usage=usage, prompt_logprobs=prompt_logprobs).model_dump()


def completion_chunk(request_id: str, created: int, model: str, text: str, finish_reason: str | None,
                     include_usage: bool, index: int = 0, logprobs: dict | None = None,
                     prompt_logprobs: list | None = None) -> dict:
    """A streamed ``text_completion`` chunk of choice ``index`` (``usage: null`` when the client asked for usage;
    ``logprobs``: its tokens'; ``prompt_logprobs``: on the first chunk of a choice that asked for them)."""
    choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
    if prompt_logprobs is not None:
        choice["prompt_logprobs"] = prompt_logprobs
    chunk = {"id": request_id, "object": "text_completion", "created": created, "model": model, "choices": [choice]}
    if include_usage:
        chunk["usage"] = None
    return chunk


def chat_chunk(request_id: str, created: int, model: str, delta: dict, finish_reason: str | None,
               include_usage: bool, index: int = 0, logprobs: dict | None = None,
               prompt_logprobs: list | None = None) -> dict:
    """A ``chat.completion.chunk`` of choice ``index`` (``delta``: ``{"role": ...}``, ``{"content": ...}`` or
    ``{}``; ``logprobs``: its tokens'; ``prompt_logprobs``: on the first chunk that carries them)."""
    chunk = {"id": request_id, "object": "chat.completion.chunk", "created": created, "model": model,
             "choices": [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}]}
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
