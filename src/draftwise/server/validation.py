"""Request validation: an OpenAI request becomes what the engine needs (:class:`GenerationRequest`: prompt token
ids, :class:`~draftwise.config.SamplingParams`, stop strings, the request's K and cache scope), or is refused
with a :class:`~draftwise.server.errors.RequestError` (a 4xx naming the field).

This is where a request is refused as the client's fault, before it is queued. Besides the API's own rules it
refuses everything :meth:`draftwise.engine.core.EngineCore.add` would (an empty prompt, token ids outside the
vocabulary, a prompt that leaves no room in the context, a K out of range: :class:`EngineLimits`), so anything
that fails once a request is queued is the server's fault, a 5xx that ``/health`` counts.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import math
import re
import threading
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from draftwise.config import MAX_LOGPROBS, SamplingParams, SpeculativeConfig
from draftwise.server.chat_messages import MessageError, normalize_tool_choice, normalize_tools, template_messages
from draftwise.server.errors import RequestError
from draftwise.server.protocol import ChatCompletionRequest, ChatMessage, CompletionRequest
from draftwise.server.settings import ServerSettings, public_model_name
from draftwise.processors.base import ProcessorChain
from draftwise.server.structured_fields import STRUCTURED_EXTRA_FIELDS, RequestedGrammar, output_grammar
from draftwise.server.text import TextCodec
from draftwise.server.tool_parsers import ToolParser, detect_tool_parser, get_tool_parser
from draftwise.server.tool_parsers.bare_json import BareJsonFallback
from draftwise.structured.grammar import GrammarCompiler, GrammarError
from draftwise.structured.spec import GrammarSpec

if TYPE_CHECKING:
    from draftwise.engine import EngineCore

logger = logging.getLogger(__name__)

__all__ = ["EngineLimits", "GenerationRequest", "RequestValidator", "cache_scope"]


@dataclass(frozen=True)
class GenerationRequest:
    """One request, ready for the engine.

    Attributes:
        request_id: ``cmpl-...`` or ``chatcmpl-...``.
        prompt_ids: prompt token ids (1 <= len < context length, each in ``[0, vocab_size)``).
        params: sampling parameters (``max_tokens`` already clamped to the context).
        stops: stop strings (cut from the output, OpenAI style).
        arrival_s: ``time.perf_counter()`` when the request arrived (for latency metrics).
        scope: who may share cached state with this request (see :func:`cache_scope`).
        num_speculative_tokens: the request's own K (0: plain decoding), or None for the server's policy.
        model: the served model name its response reports.
        tool_parser: the format the reply's tool calls are read in (a chat request with tools whose
            ``tool_choice`` is not ``"none"``), or None: the reply is all content.
        grammar: what the output must match (``response_format``, a forced ``tool_choice``, vLLM's
            ``guided_*`` / ``structured_outputs``), or None.
        processors: the request's logits processors (the compiled grammar's), applied by the engine to every
            draft and verification row; None: none. Those of choice 0 when ``n`` > 1.
        n: the number of choices generated (1 <= n <= the engine's ``max_num_seqs``: the client's ``best_of`` when
            it sent one, else its ``n``), run as a batch sharing the prompt's KV state; choice i samples with seed
            ``params.seed + i`` (vLLM's convention), so each is reproducible alone.
        choice_processors: the processors of choices 1..n-1 (each its own state), in order; empty when n == 1.
        echo: text prepended to each choice's text (``echo``: the prompt's text), ``""`` for none.
        returned: ``best_of`` > ``n``: how many of the ``n`` generated choices the response carries (the client's
            ``n``): those with the highest cumulative logprob (:func:`draftwise.logprobs.cumulative_logprob`, which
            is why ``params.logprobs`` is then at least 0); None: every choice.
        logprobs: the alternatives per output token the client asked for (chat's ``top_logprobs`` with
            ``logprobs: true``, completions' ``logprobs``), None: the response has no logprobs. ``params.logprobs``
            may be set without it (``best_of`` ranks by them).
        prompt_logprobs: vLLM's ``prompt_logprobs`` as the client asked (None: not in the response).
            ``params.prompt_logprobs`` may be set without it, or higher (``echo`` with ``logprobs`` returns the
            prompt's tokens' logprobs first).
    """

    request_id: str
    prompt_ids: tuple[int, ...]
    params: SamplingParams
    stops: tuple[str, ...] = ()
    arrival_s: float = 0.0
    scope: str = ""
    num_speculative_tokens: int | None = None
    model: str = ""
    tool_parser: ToolParser | None = None
    grammar: GrammarSpec | None = None
    processors: ProcessorChain | None = None
    n: int = 1
    choice_processors: tuple[ProcessorChain | None, ...] = ()
    echo: str = ""
    returned: int | None = None
    logprobs: int | None = None
    prompt_logprobs: int | None = None

    def choice_params(self, index: int) -> SamplingParams:
        """Choice ``index``'s sampling parameters: the request's, with seed ``seed + index`` when it has a seed."""
        if index == 0 or self.params.seed is None:
            return self.params
        return dataclasses.replace(self.params, seed=self.params.seed + index)

    def choice_processors_of(self, index: int) -> ProcessorChain | None:
        """Choice ``index``'s logits processors (:attr:`processors` for choice 0)."""
        return self.processors if index == 0 else self.choice_processors[index - 1]


@dataclass(frozen=True)
class EngineLimits:
    """What the engine core accepts of a request (:meth:`EngineCore.add` refuses anything else).

    Attributes:
        max_context: the context length in tokens (a prompt must be shorter).
        vocab_size: the width of the target's logits (valid token ids are below it).
        max_k: the engine's K (a request's ``num_speculative_tokens`` must be in 0..max_k; 0: plain decoding).
        max_num_seqs: sequences the engine runs at once (a request's ``n`` choices run together, so at most this).
    """

    max_context: int
    vocab_size: int
    max_k: int = 0
    max_num_seqs: int = 1

    @classmethod
    def of(cls, core: EngineCore) -> EngineLimits:
        """The limits :meth:`EngineCore.add` checks, read from the core and its slot backend."""
        return cls(core.backend.max_context, core.backend.vocab_size, core.num_speculative_tokens,
                   core.max_num_seqs)


def cache_scope(api_key: str | None, user: str | None) -> str:
    """The prefix-cache / suffix-index scope of a request: a digest of the bearer key it authenticated with
    (never the key itself) and its ``user`` field, so neither different keys nor different users share state.

    Args:
        api_key: the bearer token sent (None when the server needs none).
        user: the request's ``user`` field.
    """
    key = hashlib.sha256(api_key.encode()).hexdigest()[:16] if api_key else ""
    return f"{key}|{user or ''}"


class RequestValidator:
    """Validates requests against the served model and the engine's limits and builds
    :class:`GenerationRequest` objects. Thread-safe (requests are validated in worker threads).

    Args:
        codec: the target's tokenizer (thread-safe).
        limits: what the engine core accepts (:meth:`EngineLimits.of` the served core).
        settings: served names and the default ``max_tokens``.
        model_name: the target's name as loaded (a path, registry name or hub id); the server reports
            :func:`~draftwise.server.settings.public_model_name` of it unless ``settings`` names the served
            models.
    """

    def __init__(self, codec: TextCodec, limits: EngineLimits, settings: ServerSettings, model_name: str) -> None:
        self._codec = codec
        self._limits = limits
        self._default_max_tokens = settings.default_max_tokens
        self._generation_defaults = settings.generation_defaults
        self.target_name = public_model_name(model_name)
        self.served_names = settings.served_model_names or (self.target_name,)
        self.tool_parser = _tool_parser(settings.tool_call_parser, codec.chat_template)
        self._grammars: GrammarCompiler | None = None  # built at the first request with a grammar
        self._grammars_lock = threading.Lock()

    def check_model(self, requested: str | None) -> str:
        """The name to report in responses.

        Raises:
            RequestError: 404 ``model_not_found`` for a name this server does not serve.
        """
        if requested is None or requested in self.served_names:
            return self.served_names[0]
        raise RequestError(f"The model `{requested}` does not exist; this server serves "
                           f"{', '.join(repr(n) for n in self.served_names)}", param="model",
                           code="model_not_found", status=404)

    def completion(self, request: CompletionRequest, api_key: str | None = None) -> GenerationRequest:
        """Validate and tokenize a completion request.

        Args:
            request: the parsed body.
            api_key: the bearer token it sent (for its cache scope), or None.

        Raises:
            RequestError: the request is refused (4xx naming the field).
        """
        arrival = time.perf_counter()
        model = self.check_model(request.model)
        request = self._generation_defaults.apply(request)
        _reject_unsupported_common(request)
        _reject_unsupported_completion(request)
        _check_extra_fields(request)
        grammar = output_grammar(request)
        prompt = self._single_prompt(request.prompt)
        prompt_ids = self._completion_prompt(prompt, request.suffix)
        if request.suffix is not None:  # the middle ends at the model's end-of-middle tokens
            ends = [t for t in self._codec.fim_format().stop_ids if t not in (request.stop_token_ids or ())]
            request = request.model_copy(update={"stop_token_ids": [*(request.stop_token_ids or ()), *ends]})
        echo = self._echo_text(prompt) if request.echo else ""
        return self._build("cmpl", request, _Prompt(prompt_ids, "prompt", model, arrival, api_key),
                           request.max_tokens, "max_tokens", grammar=grammar, echo=echo)

    def chat(self, request: ChatCompletionRequest, api_key: str | None = None) -> GenerationRequest:
        """Validate and template a chat request.

        Args:
            request: the parsed body.
            api_key: the bearer token it sent (for its cache scope), or None.

        Raises:
            RequestError: the request is refused (4xx naming the field).
        """
        arrival = time.perf_counter()
        model = self.check_model(request.model)
        request = self._generation_defaults.apply(request)
        _reject_unsupported_common(request)
        _reject_unsupported_chat(request)
        _check_extra_fields(request)
        tools, tool_choice = _tools(request)
        parser = self._parser_for(tools, tool_choice)
        forced_calls = _forced_calls(parser, tools, tool_choice, request.parallel_tool_calls)
        grammar = output_grammar(request, forced_calls)
        prompt_ids = self._chat_prompt(request.messages, tools)
        if request.max_completion_tokens is not None:
            max_tokens, param = request.max_completion_tokens, "max_completion_tokens"
            _reject(request.max_tokens is not None and request.max_tokens < 1,  # the one it replaces: still checked
                    f"'max_tokens' must be at least 1, got {request.max_tokens}", "max_tokens")
        else:
            max_tokens, param = request.max_tokens, "max_tokens"
        return self._build("chatcmpl", request, _Prompt(prompt_ids, "messages", model, arrival, api_key),
                           max_tokens, param, tool_parser=parser, grammar=grammar)

    def _parser_for(self, tools: list[dict] | None, tool_choice: str | dict) -> ToolParser | None:
        """The parser of a request's reply: None without tools or with ``tool_choice: "none"``; else the
        model's format, which also reads a reply opening with bare JSON calls of these tools
        (:class:`~draftwise.server.tool_parsers.bare_json.BareJsonFallback`).

        Raises:
            RequestError: tools asked for on a model whose tool-call format is unknown.
        """
        if not tools or tool_choice == "none":
            return None
        if self.tool_parser is None:
            raise RequestError(f"model '{self.target_name}' has no known tool-call format (its chat template shows "
                               "none): start the server with --tool-call-parser hermes|llama3_json|mistral, or "
                               "send tool_choice 'none'", param="tools")
        if self.tool_parser.reads_bare_json:
            return self.tool_parser
        return BareJsonFallback(self.tool_parser, [tool["function"]["name"] for tool in tools])

    # ------------------------------------------------------------------ prompts
    @staticmethod
    def _single_prompt(prompt: str | list) -> str | list[int]:
        """The one prompt of a completion request (a string or token ids). Raises RequestError for a batch."""
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            if len(prompt) != 1:
                raise RequestError(f"batched prompts are not supported: send one prompt per request "
                                   f"(got {len(prompt)})", param="prompt")
            prompt = prompt[0]
        return prompt

    def _completion_prompt(self, prompt: str | list[int], suffix: str | None) -> list[int]:
        """The prompt's ids; with a ``suffix``, the fill-in-the-middle prompt (:mod:`draftwise.server.fim`).

        Raises:
            RequestError: an empty prompt; a suffix on a model without FIM tokens (naming ``suffix``).
        """
        if isinstance(prompt, str) and not prompt and suffix is None:
            raise RequestError("the prompt is empty: give at least one character or token id", param="prompt")
        if suffix is not None:
            ids = self._codec.encode_fim(prompt, suffix)
            if ids is None:
                raise RequestError(f"model '{self.target_name}' has no fill-in-the-middle tokens in its vocabulary "
                                   "(such as Qwen2.5-Coder's <|fim_prefix|>, <|fim_suffix|>, <|fim_middle|>), so "
                                   "'suffix' cannot be served: leave it out", param="suffix")
            return ids
        return self._codec.encode(prompt) if isinstance(prompt, str) else list(prompt)

    def _echo_text(self, prompt: str | list[int]) -> str:
        """The prompt's text, as ``echo`` prepends it to each choice (ids are decoded, special tokens skipped)."""
        return prompt if isinstance(prompt, str) else self._codec.detokenize(prompt)

    def _chat_prompt(self, messages: list[ChatMessage], tools: list[dict] | None) -> list[int]:
        if not messages:
            raise RequestError("'messages' must contain at least one message", param="messages")
        if not self._codec.has_chat_template:
            raise RequestError(f"model '{self.target_name}' has no chat template, so chat requests cannot be "
                               "formatted: use /v1/completions, or start the server with --chat-template",
                               param="messages", code="chat_template_missing")
        try:
            converted = template_messages([m.model_dump(exclude_none=True) for m in messages])
        except MessageError as exc:
            raise RequestError(str(exc), param=_dotted(exc.param)) from exc
        try:
            return self._codec.encode_chat(converted, tools)
        except Exception as exc:  # jinja2 TemplateError (raise_exception in templates), ValueError...
            raise RequestError(f"the chat template rejected the messages: {exc}", param="messages") from exc

    def _check_prompt_ids(self, ids: list[int], param: str) -> None:
        """What :meth:`EngineCore.add` refuses of a prompt: no token, a token id outside the vocabulary (from
        the client or from the tokenizer), or no room left in the context for a new token.

        Raises:
            RequestError: naming ``param`` (``"prompt"`` or ``"messages"``).
        """
        if not ids:
            raise RequestError("the prompt is empty: at least one token is needed", param=param)
        vocab_size = self._limits.vocab_size
        if min(ids) < 0 or max(ids) >= vocab_size:
            bad = next(t for t in ids if not 0 <= t < vocab_size)
            raise RequestError(f"prompt token id {bad} is outside the vocabulary [0, {vocab_size})", param=param)
        if len(ids) >= self._limits.max_context:
            raise RequestError(f"This model's maximum context length is {self._limits.max_context} tokens; the "
                               f"prompt has {len(ids)} tokens, which leaves no room for new tokens. Please shorten "
                               "it.", param=param, code="context_length_exceeded")

    #: at most this many ``stop_token_ids`` per request (each is a set lookup per committed token)
    MAX_STOP_TOKEN_IDS = 1024

    def _check_stop_token_ids(self, ids: list[int] | None) -> None:
        """``stop_token_ids``: at most :attr:`MAX_STOP_TOKEN_IDS`, each inside the vocabulary. Raises
        RequestError."""
        if not ids:
            return
        if len(ids) > self.MAX_STOP_TOKEN_IDS:
            raise RequestError(f"at most {self.MAX_STOP_TOKEN_IDS} stop_token_ids are supported, got {len(ids)}",
                               param="stop_token_ids")
        vocab_size = self._limits.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab_size]
        if bad:
            shown = _count(bad[0]) if bad[0] >= 0 else f"-{_count(-bad[0])}"
            raise RequestError(f"stop token id {shown} is outside the vocabulary [0, {vocab_size})",
                               param="stop_token_ids")

    # ------------------------------------------------------------------ sampling
    def _processors(self, grammar: RequestedGrammar | None) -> ProcessorChain | None:
        """The request's processor chain: its grammar compiled for the target's vocabulary (cached), or None.

        Raises:
            RequestError: a grammar that cannot be compiled (an invalid schema, regex or EBNF), naming its field.
        """
        if grammar is None:
            return None
        with self._grammars_lock:
            if self._grammars is None:
                self._grammars = GrammarCompiler(self._codec.grammar_vocabulary(self._limits.vocab_size))
        try:
            return ProcessorChain([self._grammars.processor(grammar.spec)])
        except GrammarError as exc:
            raise RequestError(f"{grammar.field} cannot be followed: {exc}", param=grammar.field) from exc

    def _build(self, kind: str, request, prompt: _Prompt, max_tokens: int | None, max_param: str, *,
               tool_parser: ToolParser | None = None, grammar: RequestedGrammar | None = None, echo: str = "",
               ) -> GenerationRequest:
        self._check_prompt_ids(prompt.ids, prompt.param)
        limit = self._max_tokens(len(prompt.ids), max_tokens, max_param)
        self._check_stop_token_ids(request.stop_token_ids)
        n = self._choices(request)
        returned = None if n == _client_n(request) else _client_n(request)  # best_of > n: the best n of them
        logprobs = _asked_logprobs(request)
        return GenerationRequest(
            request_id=f"{kind}-{uuid.uuid4().hex}",
            prompt_ids=tuple(prompt.ids),
            params=_with_logprobs(_sampling_params(request, limit, self._limits.vocab_size), logprobs,
                                  request.prompt_logprobs, echoed=bool(echo), ranked=returned is not None),
            stops=_stop_strings(request.stop),
            arrival_s=prompt.arrival_s,
            scope=cache_scope(prompt.api_key, request.user),
            num_speculative_tokens=self._request_k(request.num_speculative_tokens),
            model=prompt.model,
            tool_parser=tool_parser,
            grammar=grammar.spec if grammar is not None else None,
            processors=self._processors(grammar),
            n=n,
            choice_processors=tuple(self._processors(grammar) for _ in range(n - 1)),
            echo=echo,
            returned=returned,
            logprobs=logprobs,
            prompt_logprobs=request.prompt_logprobs,
        )

    def _choices(self, request) -> int:
        """The number of choices the request generates: its ``best_of`` when set (completions), else its ``n``;
        1..the engine's ``max_num_seqs`` (its choices run together), and with a seed, ``seed + n - 1`` still a
        valid seed (choice i samples with ``seed + i``).

        Raises:
            RequestError: naming ``n``, ``best_of`` or ``seed``.
        """
        n, param = _client_n(request), "n"
        if getattr(request, "best_of", None) is not None:
            n, param = request.best_of, "best_of"
        max_n = self._limits.max_num_seqs
        _reject(n > max_n, f"{param}={n} is more than this server runs at once (--max-num-seqs {max_n}): the "
                f"choices of a request run together, so {param} must be at most {max_n}", param)
        _reject(request.seed is not None and n > 1 and request.seed + n - 1 >= 2**63,
                f"with n={n}, choice i samples with seed + i, so the seed must be below 2**63 - {n - 1}", "seed")
        return n

    def _request_k(self, requested: int | None) -> int | None:
        if requested is None:
            return None
        max_k = self._limits.max_k
        if max_k == 0 and requested != 0:
            raise RequestError(f"this server decodes plainly (started without a speculative method), so "
                               f"'num_speculative_tokens' can only be 0 or left out, got {requested}",
                               param="num_speculative_tokens")
        if not 0 <= requested <= max_k:
            raise RequestError(f"'num_speculative_tokens' must be in 0..{max_k} (0 turns speculation off; "
                               f"this server speculates at most {max_k} tokens), got {requested}",
                               param="num_speculative_tokens")
        return requested

    def _max_tokens(self, prompt_len: int, requested: int | None, param: str) -> int:
        """The request's ``max_tokens``, or the default (None: the whole room) clamped to the context room
        (the prompt leaves >= 1)."""
        max_context = self._limits.max_context
        room = max_context - prompt_len
        if requested is None:
            return room if self._default_max_tokens is None else min(self._default_max_tokens, room)
        if requested < 1:
            raise RequestError(f"'{param}' must be at least 1, got {requested}", param=param)
        if requested > room:
            asked = _count(requested)
            total = _count(prompt_len + requested) if asked == str(requested) else f"more than {max_context}"
            raise RequestError(f"This model's maximum context length is {max_context} tokens. However, you "
                               f"requested {total} tokens ({prompt_len} in the prompt, {asked} "
                               f"for the completion). Please reduce the prompt or '{param}'.",
                               param=param, code="context_length_exceeded")
        return requested


@dataclass(frozen=True)
class _Prompt:
    """A request's prompt ids and what travels with them into :class:`GenerationRequest`."""

    ids: list[int]
    param: str  # the field named when the prompt is refused: "prompt" or "messages"
    model: str
    arrival_s: float
    api_key: str | None


def _count(value: int) -> str:
    """An integer for a message: its digits, or how many digits it has when it is too long to print (Python
    refuses to convert integers past 4,300 digits, and an error should not echo kilobytes)."""
    digits = math.floor(math.log10(value)) + 1 if value > 0 else 1
    if digits > 1 and 10 ** (digits - 1) > value:  # log10 rounded up (999...9)
        digits -= 1
    return str(value) if digits < 30 else f"a {digits}-digit number"


def _sampling_params(request, max_tokens: int, vocab_size: int) -> SamplingParams:
    """OpenAI defaults: temperature 1, top_p 1. vLLM's ``top_k=-1`` means disabled.

    ``temperature`` must be a finite number >= 0 and ``top_p`` a finite number in (0, 1] (NaN and infinities,
    which Python's JSON reader accepts, are 400s); ``logit_bias`` keys token ids below ``vocab_size``
    (:func:`_logit_bias`); further limits (penalties, ``min_tokens``, ``min_p``, bias values) are
    :class:`SamplingParams`' own, each a 400 naming its field.
    """
    _check_temperature_and_top_p(request.temperature, request.top_p)
    top_k = request.top_k if request.top_k is not None else 0
    try:
        return SamplingParams(
            temperature=1.0 if request.temperature is None else request.temperature,
            top_p=1.0 if request.top_p is None else request.top_p,
            top_k=0 if top_k == -1 else top_k,
            max_tokens=max_tokens,
            seed=request.seed,
            stop_token_ids=tuple(request.stop_token_ids or ()),
            ignore_eos=request.ignore_eos,
            sampling=request.sampling,
            presence_penalty=request.presence_penalty or 0.0,
            frequency_penalty=request.frequency_penalty or 0.0,
            repetition_penalty=1.0 if request.repetition_penalty is None else request.repetition_penalty,
            logit_bias=_logit_bias(request.logit_bias, vocab_size),
            min_tokens=request.min_tokens or 0,
            min_p=request.min_p or 0.0,
        )
    except ValueError as exc:
        message = str(exc)
        param = message.split(" ", 1)[0]
        raise RequestError(message, param=param if param in _SAMPLING_FIELDS else None) from exc


_SAMPLING_FIELDS = {"temperature", "top_p", "top_k", "max_tokens", "seed", "sampling", "presence_penalty",
                    "frequency_penalty", "repetition_penalty", "logit_bias", "min_tokens", "min_p"}


def _logit_bias(bias: dict[str, float] | None, vocab_size: int) -> dict[int, float]:
    """``logit_bias`` with its keys read as token ids (OpenAI sends them as strings of digits); the values are
    checked by :class:`SamplingParams`.

    Raises:
        RequestError: naming ``logit_bias``: a key that is not an integer, a token id outside
            ``[0, vocab_size)``, or one id given twice (``"5"`` and ``"05"``).
    """
    parsed: dict[int, float] = {}
    for key, value in (bias or {}).items():
        try:
            token = int(key)
        except ValueError:  # not digits, or past Python's 4,300-digit limit
            raise RequestError(f"logit_bias keys must be token ids (integers as strings), got "
                               f"{key[:_LOGGED_NAME_CHARS]!r}", param="logit_bias") from None
        if not 0 <= token < vocab_size:
            shown = _count(token) if token >= 0 else f"-{_count(-token)}"
            raise RequestError(f"logit_bias token id {shown} is outside the vocabulary [0, {vocab_size})",
                               param="logit_bias")
        _reject(token in parsed, f"logit_bias names token {token} twice", "logit_bias")
        parsed[token] = value
    return parsed


def _check_temperature_and_top_p(temperature: float | None, top_p: float | None) -> None:
    """The server's own range checks, so every bad value is a 400 naming its field."""
    if temperature is not None:
        _reject(not math.isfinite(temperature), f"temperature must be a finite number, got {temperature}",
                "temperature")
        _reject(temperature < 0, f"temperature must be >= 0 (0 is greedy), got {temperature}", "temperature")
    if top_p is not None:
        _reject(not math.isfinite(top_p), f"top_p must be a finite number, got {top_p}", "top_p")
        _reject(not 0 < top_p <= 1, f"top_p must be in (0, 1], got {top_p}", "top_p")


MAX_STOP_STRINGS = 16


def _stop_strings(stop: str | Sequence[str] | None) -> tuple[str, ...]:
    """At most :data:`MAX_STOP_STRINGS` non-empty strings (OpenAI allows 4)."""
    stops = (stop,) if isinstance(stop, str) else tuple(stop or ())
    if any(not s for s in stops):
        raise RequestError("stop sequences must be non-empty strings", param="stop")
    if len(stops) > MAX_STOP_STRINGS:
        raise RequestError(f"at most {MAX_STOP_STRINGS} stop sequences are supported, got {len(stops)}",
                           param="stop")
    return stops


def _reject(condition: bool, message: str, param: str) -> None:
    if condition:
        raise RequestError(message, param=param)


# Extra fields that name a speculative setting: the server's own (serve --speculative-config, --k-policy...), so
# a request that sends one would otherwise believe it took effect. The per-request one is num_speculative_tokens.
# Matched on whole words of the name ("draft_model", not "drafts_enabled"; "k_policy", not "fallback_policy").
_SERVER_SETTING_WORDS = frozenset({"speculative", "speculation", "draft", "proposer"})
# Every --speculative-config field (one list: the config's own), less the OpenAI "model" and the per-request K.
_SERVER_SETTING_NAMES = frozenset({"kpolicy"} | {field.name for field in dataclasses.fields(SpeculativeConfig)}
                                  - {"model", "num_speculative_tokens"})
# vLLM's extra sampling fields that change the output, which this server does not implement: a 400, never ignored
_UNSUPPORTED_VLLM_FIELDS = ("use_beam_search", "length_penalty", "allowed_token_ids", "bad_words",
                            "logits_processors", "include_stop_str_in_output",
                            "truncate_prompt_tokens")
# extra fields this server serves (not part of OpenAI's schema): not logged as ignored
_SERVED_EXTRA_FIELDS = frozenset(STRUCTURED_EXTRA_FIELDS) | {"response_format"}
_LOGGED_NAMES = 10  # unknown field names a log line lists (then a count)
_LOGGED_NAME_CHARS = 40


def _names_a_server_setting(name: str) -> bool:
    lowered = name.lower()
    words = set(re.split(r"[^a-z0-9]+", lowered))
    return lowered in _SERVER_SETTING_NAMES or bool(words & _SERVER_SETTING_WORDS)


def _changes_the_output(value) -> bool:
    """A vLLM extra sent with a value that is not its no-op default (unset, false, empty, 0)."""
    return value not in (None, False, 0, "", [], {})


def _check_extra_fields(request) -> None:
    """A request's fields outside the API (after :func:`_reject_unsupported_common`): a 400 for one naming a
    speculative setting (the server's, set at ``serve``; per request only ``num_speculative_tokens``); the others
    are logged as ignored (names escaped and the list cut short), as vLLM does."""
    extra = request.model_extra or {}
    for name in extra:
        _reject(_names_a_server_setting(name),
                f"{name[:_LOGGED_NAME_CHARS]!r} is not a per-request setting: speculative decoding is configured when "
                "the server starts (serve --speculative-config, --num-speculative-tokens); a request may set only "
                "'num_speculative_tokens' (0 for plain decoding)", name)
    options = request.stream_options.model_extra if request.stream_options is not None else None
    extra = {name: value for name, value in extra.items() if name not in _SERVED_EXTRA_FIELDS}
    extra = {**extra, **{f"stream_options.{name}": value for name, value in (options or {}).items()}}
    if extra:
        names = sorted(extra)
        shown = ", ".join(repr(n[:_LOGGED_NAME_CHARS]) for n in names[:_LOGGED_NAMES])
        more = f" and {len(names) - _LOGGED_NAMES} more" if len(names) > _LOGGED_NAMES else ""
        logger.warning("request fields ignored (not part of the API this server serves): %s%s", shown, more)


def _reject_unsupported_common(request) -> None:
    """Fields that would change the output in ways this server does not implement -> 400 (never ignored)."""
    n = 1 if request.n is None else request.n
    _reject(n < 1, f"'n' must be at least 1, got {n}", "n")
    for name, value in (request.model_extra or {}).items():  # vLLM extras outside the protocol's fields
        _reject(name in _UNSUPPORTED_VLLM_FIELDS and _changes_the_output(value), f"{name} is not supported", name)


def _reject_unsupported_completion(request: CompletionRequest) -> None:
    _check_best_of(request)
    _check_logprob_count(request.logprobs, MAX_COMPLETION_LOGPROBS, "logprobs")
    _check_logprob_count(request.prompt_logprobs, MAX_LOGPROBS, "prompt_logprobs")
    extra = request.model_extra or {}  # chat fields sent to the completions endpoint change nothing here: refuse
    _reject(bool(extra.get("tools")) or bool(extra.get("functions")),
            "tools are served on /v1/chat/completions (and /v1/responses), not on /v1/completions", "tools")
    _reject(extra.get("top_logprobs") not in (None, 0),
            "top_logprobs is a chat completions field: on /v1/completions, 'logprobs' (0..5) asks for the most "
            "likely tokens", "top_logprobs")


def _check_best_of(request: CompletionRequest) -> None:
    """``best_of``: unset, or at least ``n`` (``best_of`` choices are generated and the ``n`` with the highest
    cumulative logprob returned, as OpenAI and vLLM do); above ``n``, not with ``stream`` (the best are known only
    at the end; OpenAI refuses it too). Its upper bound, ``--max-num-seqs``, is checked with ``n``'s.

    Raises:
        RequestError: naming ``best_of``.
    """
    n = _client_n(request)
    best_of = request.best_of
    if best_of is None:
        return
    _reject(best_of < 1, f"'best_of' must be at least 1, got {best_of}", "best_of")
    _reject(best_of < n, f"'best_of' ({best_of}) must be at least 'n' ({n})", "best_of")
    _reject(best_of > n and request.stream, f"best_of={best_of} (more than n={n}) cannot be streamed: the best "
            "choices are known only once all are generated; send stream false, or best_of equal to n", "best_of")


def _client_n(request) -> int:
    """The request's ``n`` (1 when unset): the choices it gets back."""
    return 1 if request.n is None else request.n


def _reject_unsupported_chat(request: ChatCompletionRequest) -> None:
    _check_logprob_count(request.top_logprobs, MAX_LOGPROBS, "top_logprobs")
    _reject(request.top_logprobs not in (None, 0) and not request.logprobs,
            "'top_logprobs' needs 'logprobs' set to true", "top_logprobs")
    _check_logprob_count(request.prompt_logprobs, MAX_LOGPROBS, "prompt_logprobs")


#: OpenAI's limit on ``/v1/completions``' ``logprobs`` (chat's ``top_logprobs`` goes to :data:`MAX_LOGPROBS`).
MAX_COMPLETION_LOGPROBS = 5


def _check_logprob_count(value: int | None, most: int, param: str) -> None:
    """A count of alternatives per token: unset, or an integer in ``0..most``. Raises RequestError."""
    if value is not None and not 0 <= value <= most:
        shown = _count(value) if value >= 0 else f"-{_count(-value)}"
        raise RequestError(f"'{param}' must be in 0..{most}, got {shown}", param=param)


def _asked_logprobs(request) -> int | None:
    """The alternatives per output token the client asked for: chat's ``top_logprobs`` (default 0) with
    ``logprobs: true``, completions' ``logprobs``; None: no logprobs. The counts were checked by
    :func:`_reject_unsupported_chat` / :func:`_reject_unsupported_completion`."""
    if isinstance(request, ChatCompletionRequest):
        return (request.top_logprobs or 0) if request.logprobs else None
    return request.logprobs


def _with_logprobs(params: SamplingParams, logprobs: int | None, prompt_logprobs: int | None, *, echoed: bool,
                   ranked: bool) -> SamplingParams:
    """``params`` with the log-probabilities the engine computes (:mod:`draftwise.logprobs`): the client's
    ``logprobs`` and vLLM's ``prompt_logprobs``; with ``echoed`` (``echo`` and ``logprobs``: the echoed prompt's
    tokens carry theirs) prompt logprobs with at least ``logprobs`` alternatives; with ``ranked`` (``best_of`` >
    ``n``, which ranks the choices by their tokens' logprobs) output logprobs (0 alternatives) even when the
    client asked for none. The response returns only what the client asked for
    (:attr:`GenerationRequest.logprobs`, :attr:`GenerationRequest.prompt_logprobs`)."""
    if echoed and logprobs is not None:
        prompt_logprobs = max(prompt_logprobs or 0, logprobs)
    if ranked and logprobs is None:
        logprobs = 0
    if logprobs is None and prompt_logprobs is None:
        return params
    return dataclasses.replace(params, logprobs=logprobs, prompt_logprobs=prompt_logprobs)


def _dotted(param: str) -> str:
    """A field path in this server's notation (pydantic's, ``messages.1.tool_calls.0``), from OpenAI's
    (``messages[1].tool_calls[0]``)."""
    return re.sub(r"\[(\d+)\]", r".\1", param)


def _tool_parser(name: str | None, chat_template: str | None) -> ToolParser | None:
    """The server's tool-call parser: the named one, ``"none"`` for none, else the one the chat template's
    format shows (None when it shows none)."""
    if name == "none":
        return None
    name = name or detect_tool_parser(chat_template)
    if name is None:
        return None
    logger.info("tool calls are read in the %s format", name)
    return get_tool_parser(name)


def _tools(request: ChatCompletionRequest) -> tuple[list[dict] | None, str | dict]:
    """The request's function tools and ``tool_choice`` (legacy ``functions`` / ``function_call`` converted).

    Raises:
        RequestError: malformed tools or choice, naming the field.
    """
    try:
        tools = normalize_tools(request.tools, request.functions)
        return tools, normalize_tool_choice(request.tool_choice, request.function_call, tools)
    except MessageError as exc:
        raise RequestError(str(exc), param=_dotted(exc.param)) from exc


def _forced_calls(parser: ToolParser | None, tools: list[dict] | None, tool_choice: str | dict,
                  parallel_tool_calls: bool | None) -> GrammarSpec | None:
    """The grammar that forces calls (``tool_choice`` ``"required"`` or a named function), else None."""
    if parser is None:
        return None
    try:
        return parser.call_grammar(tools or [], tool_choice, parallel_tool_calls is not False)
    except ValueError as exc:
        raise RequestError(str(exc), param="tool_choice") from exc

