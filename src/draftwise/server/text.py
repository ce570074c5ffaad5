"""The server's text codec: text to token ids (:class:`TextCodec`, a pool of tokenizer copies for prompts and
chat templates) and token ids to streamed text (:class:`OutputText`: incremental detokenization and OpenAI-exact
stop strings).

The decoding classes are fed one token (or one text delta) at a time, so the text a request produces does not
depend on how many tokens each speculative step commits: a streamed response, a non-streamed response, plain
decoding and speculative decoding all go through the same per-token path.
"""

from __future__ import annotations

import copy
import dataclasses
import queue
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

from draftwise.models.loading import LoadedModel
from draftwise.server.fim import FimFormat, detect_fim
from draftwise.structured.grammar import TokenVocabulary

__all__ = ["TextCodec", "IncrementalDetokenizer", "StopStringMatcher", "OutputText", "PROMPT_CONTEXT_TOKENS"]


# ---------------------------------------------------------------------- text -> ids
class TextCodec:
    """Tokenization for one model, safe to use from many threads at once.

    Request handlers encode in worker threads while the engine thread decodes, and a tokenizer object must not
    be shared between threads: a ``transformers`` fast tokenizer reconfigures its Rust backend during calls,
    and a concurrent call then fails with ``RuntimeError: Already borrowed`` (huggingface/tokenizers#537;
    vLLM's fix, vllm-project/vllm#41181, is the same pool of copies). So the engine thread decodes with a
    private copy and never waits for an encoding, however long (a multi-megabyte prompt takes seconds), and
    encodings borrow one of up to ``copies`` private copies, so they run in parallel and a long one holds up
    no other request unless ``copies`` long ones run at once. Tokenizers that are not ``transformers``
    tokenizers (llama.cpp's, whose calls only read the vocabulary, as llama-server's HTTP threads do) are
    shared, not copied.

    Args:
        model: the target model (tokenizer and chat template).
        chat_template: a Jinja template that replaces the tokenizer's, or None.
        copies: the most tokenizer copies used for encoding at the same time (>= 1).

    Raises:
        ValueError: ``copies`` < 1.
    """

    def __init__(self, model: LoadedModel, chat_template: str | None = None, copies: int = 4) -> None:
        if copies < 1:
            raise ValueError(f"copies must be >= 1, got {copies}")
        self._model = model
        self._chat_template = chat_template
        self._decoder = _private_copy(model)
        self._encoders = _ModelPool(model, copies)
        self._fim: FimFormat | None | bool = False  # False: not looked up yet
        self._fim_lock = threading.Lock()
        self._token_bytes: list[bytes] | None = None  # each id's bytes, read once (token_bytes)
        self._token_bytes_lock = threading.Lock()

    @property
    def has_chat_template(self) -> bool:
        """True when chat requests can be served."""
        return bool(self._chat_template) or self._model.has_chat_template

    def grammar_vocabulary(self, vocab_size: int) -> TokenVocabulary:
        """The target tokenizer's vocabulary for a grammar engine (token strings, the model's EOS ids as the stop
        tokens), ``vocab_size`` wide (the logits' width; ids past the tokenizer's are never allowed)."""
        with self._encoders.borrow() as model:
            return TokenVocabulary.from_huggingface(model.tokenizer, stop_token_ids=model.eos_token_ids,
                                                    vocab_size=vocab_size)

    @property
    def chat_template(self) -> str | None:
        """The chat template's text (the server's ``--chat-template``, else the tokenizer's), or None."""
        template = self._chat_template or getattr(self._model.tokenizer, "chat_template", None)
        return template if isinstance(template, str) else None

    def encode(self, text: str) -> list[int]:
        """Plain text -> ids (with the tokenizer's usual BOS handling)."""
        with self._encoders.borrow() as model:
            return model.encode(text)

    def encode_chat(self, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
        """Messages (and function ``tools``, written into the prompt by the template) -> ids through the chat
        template, with the assistant generation prompt.

        Raises:
            ValueError: no chat template; also whatever the template raises for bad message orders.
        """
        with self._encoders.borrow() as model:
            if not self._chat_template:
                return model.encode_chat(messages, tools)
            ids = model.tokenizer.apply_chat_template(
                messages, tools=tools, chat_template=self._chat_template, add_generation_prompt=True, tokenize=True
            )
        if isinstance(ids, dict) or hasattr(ids, "keys"):
            ids = ids["input_ids"]
        return [int(t) for t in ids]

    def encode_fim(self, prefix: str | Sequence[int], suffix: str) -> list[int] | None:
        """A fill-in-the-middle prompt (:mod:`draftwise.server.fim`): ``prefix`` (text, or token ids taken as
        they are) and ``suffix`` (text) in the model's FIM order, the FIM tokens as single ids; None when the
        model's vocabulary has no FIM tokens."""
        fim = self.fim_format()
        if fim is None:
            return None
        with self._encoders.borrow() as model:
            prefix_ids = list(prefix) if not isinstance(prefix, str) else _plain_ids(model, prefix)
            return fim.prompt_ids(prefix_ids, _plain_ids(model, suffix))

    def fim_format(self) -> FimFormat | None:
        """The model's FIM tokens (looked up in its vocabulary once), or None."""
        with self._fim_lock:
            if self._fim is False:
                with self._encoders.borrow() as model:
                    self._fim = _fim_of(model.tokenizer)
            return self._fim

    def detokenize(self, token_ids: Sequence[int]) -> str:
        """Ids -> text (special tokens skipped) from any thread (a prompt given as ids, echoed back)."""
        with self._encoders.borrow() as model:
            return model.decode(list(token_ids))
    def token_bytes(self, token_ids: Sequence[int], vocab_size: int) -> list[bytes]:
        """The bytes each token adds to the text (``b" time"``; a byte-fallback token's one byte; a special token's
        own text, ``b"</s>"``), as the grammar engine reads them from the tokenizer (its vocabulary is
        ``vocab_size`` wide, the logits'); ids past the tokenizer's vocabulary give ``b""``. For logprobs' token
        strings and ``bytes``. Thread-safe; the table is read at the first call."""
        with self._token_bytes_lock:
            if self._token_bytes is None:
                self._token_bytes = list(self.grammar_vocabulary(vocab_size).info.decoded_vocab)
        table = self._token_bytes
        return [table[t] if 0 <= t < len(table) else b"" for t in token_ids]

    def decode(self, token_ids: list[int]) -> str:
        """Ids -> text, special tokens skipped. For the engine thread only (it owns the decoding copy)."""
        return self._decoder.decode(token_ids)


def _plain_ids(model: LoadedModel, text: str) -> list[int]:
    """Text -> ids without the special tokens a tokenizer adds (BOS), for a piece inside a FIM prompt."""
    try:
        return [int(t) for t in model.tokenizer.encode(text, add_special_tokens=False)]
    except TypeError:  # a tokenizer without the flag (llama.cpp's)
        return model.encode(text)


def _fim_of(tokenizer) -> FimFormat | None:
    """The FIM format of a tokenizer's vocabulary (``get_vocab()``, with added special tokens), or None."""
    get_vocab = getattr(tokenizer, "get_vocab", None)
    if get_vocab is None:
        return None
    adds_bos = getattr(tokenizer, "add_bos_token", False)
    return detect_fim(get_vocab(), getattr(tokenizer, "bos_token_id", None) if adds_bos else None)


def _copyable(model: LoadedModel) -> bool:
    """True for ``transformers`` tokenizers (copied per thread); others are shared (see :class:`TextCodec`)."""
    from transformers import PreTrainedTokenizerBase

    return isinstance(model.tokenizer, PreTrainedTokenizerBase)


def _private_copy(model: LoadedModel) -> LoadedModel:
    """The model with its own deep copy of the tokenizer (the backend is shared), or the model itself."""
    if not _copyable(model):
        return model
    return dataclasses.replace(model, tokenizer=copy.deepcopy(model.tokenizer))


class _ModelPool:
    """Up to ``size`` private tokenizer copies, created on first need and lent to one thread at a time."""

    def __init__(self, model: LoadedModel, size: int) -> None:
        self._model = model
        self._shared = not _copyable(model)
        self._size = size
        self._free: queue.LifoQueue[LoadedModel] = queue.LifoQueue()
        self._created = 0
        self._lock = threading.Lock()

    @contextmanager
    def borrow(self) -> Iterator[LoadedModel]:
        """Lend a copy for the duration of the ``with`` block (waits only when all ``size`` copies are lent)."""
        if self._shared:
            yield self._model
            return
        model = self._take()
        try:
            yield model
        finally:
            self._free.put(model)

    def _take(self) -> LoadedModel:
        try:
            return self._free.get_nowait()
        except queue.Empty:
            pass
        with self._lock:
            create = self._created < self._size
            if create:
                self._created += 1
        return _private_copy(self._model) if create else self._free.get()


# ---------------------------------------------------------------------- ids -> text
# Prompt tokens decoded together with the first generated tokens, so a leading space that SentencePiece-style
# decoders strip from the first token of a sequence is kept ("Once upon a" + "▁time" -> " time").
PROMPT_CONTEXT_TOKENS = 6

_REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas.

    Decodes a short sliding window (the tokens since the last-but-one emission) instead of the whole
    sequence, and emits the text the newest tokens add. Text that ends in an incomplete UTF-8 sequence
    (decoded as U+FFFD) is held back until the following tokens complete it.

    Args:
        decode: ids -> text (special tokens skipped), e.g. :meth:`LoadedModel.decode`.
        context_ids: tokens that precede the generated ones (the prompt's tail); their text is never emitted.
    """

    def __init__(self, decode: Callable[[list[int]], str], context_ids: Sequence[int] = ()) -> None:
        self._decode = decode
        self._tokens = [int(t) for t in context_ids]
        self._prefix_offset = 0  # window start
        self._read_offset = len(self._tokens)  # end of the text already emitted

    def add(self, token_id: int) -> str:
        """Append one token; return the text it completes ("" while a character is incomplete)."""
        self._tokens.append(int(token_id))
        prefix_text, new_text = self._window_texts()
        if len(new_text) <= len(prefix_text) or new_text.endswith(_REPLACEMENT_CHAR):
            return ""
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._tokens)
        return new_text[len(prefix_text):]

    def flush(self) -> str:
        """Return any held-back text (an incomplete character is emitted as U+FFFD); call once at the end."""
        prefix_text, new_text = self._window_texts()
        self._prefix_offset = self._read_offset = len(self._tokens)
        return new_text[len(prefix_text):] if len(new_text) > len(prefix_text) else ""

    def _window_texts(self) -> tuple[str, str]:
        window = self._tokens[self._prefix_offset:]
        emitted = self._read_offset - self._prefix_offset
        return self._decode(window[:emitted]) if emitted else "", self._decode(window)


class _PrefixAutomaton:
    """Knuth-Morris-Pratt matcher for one pattern, fed one character at a time.

    :attr:`state` is the length of the longest suffix of the text so far that is a prefix of the pattern.
    """

    def __init__(self, pattern: str) -> None:
        self.pattern = pattern
        self.state = 0
        self._fail = [0] * len(pattern)
        k = 0
        for i in range(1, len(pattern)):
            while k and pattern[i] != pattern[k]:
                k = self._fail[k - 1]
            if pattern[i] == pattern[k]:
                k += 1
            self._fail[i] = k

    def step(self, char: str) -> bool:
        """Advance by one character; True when the pattern ends here."""
        state = self.state
        while state and self.pattern[state] != char:
            state = self._fail[state - 1]
        if self.pattern[state] == char:
            state += 1
        if state == len(self.pattern):
            self.state = self._fail[state - 1]
            return True
        self.state = state
        return False


class StopStringMatcher:
    """Cuts a text stream at the first stop string to appear, as OpenAI does.

    The text is scanned one character at a time, so the result does not depend on how it is split into deltas:
    generation stops as soon as a stop string is complete, and the output ends right before it (the stop
    string is not included; when several complete at the same character, the cut is at the earliest start).
    Text that could be the beginning of a stop string is held back until it is known not to be one, so streamed
    text never has to be retracted. Linear time in the text length per stop string.

    Args:
        stops: non-empty stop strings (empty tuple: pass-through).

    Raises:
        ValueError: an empty stop string.
    """

    def __init__(self, stops: Sequence[str] = ()) -> None:
        if any(not s for s in stops):
            raise ValueError("stop strings must be non-empty")
        self._automata = [_PrefixAutomaton(s) for s in dict.fromkeys(stops)]
        self._text = ""
        self._emitted = 0
        self.stopped = False

    def feed(self, delta: str) -> str:
        """Add text; return the part that is now safe to emit. After a match, :attr:`stopped` is True and
        further input is ignored."""
        if self.stopped or not delta:
            return ""
        if not self._automata:
            self._text += delta
            return self._take(len(self._text))
        for i, char in enumerate(delta):
            ended = [a for a in self._automata if a.step(char)]  # step every automaton on every character
            if ended:
                end = len(self._text) + i + 1
                self._text = (self._text + delta[:i + 1])[:end - max(len(a.pattern) for a in ended)]
                self.stopped = True
                return self._take(len(self._text))
        self._text += delta
        held = max(a.state for a in self._automata)
        return self._take(max(self._emitted, len(self._text) - held))

    def flush(self) -> str:
        """Return the held-back text (a partial stop string that never completed); call once at the end."""
        return self._take(len(self._text))

    @property
    def text(self) -> str:
        """All text emitted so far."""
        return self._text[:self._emitted]

    def _take(self, end: int) -> str:
        out = self._text[self._emitted:end]
        self._emitted = max(self._emitted, end)
        return out


class OutputText:
    """The text of one generation: detokenizer + stop strings, fed token by token.

    Args:
        decode: ids -> text, special tokens skipped.
        prompt_ids: the request's prompt (its last :data:`PROMPT_CONTEXT_TOKENS` give decoding context).
        stops: stop strings.

    Attributes:
        num_tokens: generated tokens consumed so far; after a stop string, the tokens up to and including the
            one that completed it (OpenAI's ``completion_tokens``).
    """

    def __init__(self, decode: Callable[[list[int]], str], prompt_ids: Sequence[int], stops: Sequence[str] = ()):
        self._detokenizer = IncrementalDetokenizer(decode, prompt_ids[-PROMPT_CONTEXT_TOKENS:])
        self._stops = StopStringMatcher(stops)
        self.num_tokens = 0

    @property
    def stopped(self) -> bool:
        """True once a stop string matched; no more tokens are consumed."""
        return self._stops.stopped

    @property
    def text(self) -> str:
        """All text emitted so far."""
        return self._stops.text

    def add_tokens(self, token_ids: Sequence[int]) -> str:
        """Consume tokens (stopping at a stop string); return the new text that is safe to emit."""
        out = []
        for token in token_ids:
            if self.stopped:
                break
            self.num_tokens += 1
            out.append(self._stops.feed(self._detokenizer.add(token)))
        return "".join(out)

    def finish(self) -> str:
        """Return the remaining held-back text at the end of the generation."""
        if self.stopped:
            return ""
        tail = self._stops.feed(self._detokenizer.flush())
        return tail + ("" if self.stopped else self._stops.flush())
