"""Token ids to streamed text: incremental detokenization and OpenAI-exact stop strings.

Both classes are fed one token (or one text delta) at a time, so the text a request produces does not depend
on how many tokens each speculative step commits: a streamed response, a non-streamed response, plain
decoding and speculative decoding all go through the same per-token path.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

__all__ = ["IncrementalDetokenizer", "StopStringMatcher", "OutputText", "PROMPT_CONTEXT_TOKENS"]

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
