"""Server text pipeline: incremental detokenization (UTF-8 hold-back, leading spaces) and OpenAI stop strings."""

from __future__ import annotations

import pytest

from draftwise.server.text import IncrementalDetokenizer, OutputText, StopStringMatcher

# A byte-level toy vocabulary: "é" (0xC3 0xA9) is split over two tokens; "▁x" tokens carry a leading space that
# the decoder strips at the start of a sequence, as SentencePiece decoders do.
VOCAB = {0: b"Hello", 1: b"\xe2\x96\x81world", 2: b"\xc3", 3: b"\xa9", 4: b"!", 5: b"\xe2\x96\x81caf", 6: b"STOP",
         7: b"\xe2\x96\x81again", 8: b"S", 9: b"TOP"}


def toy_decode(ids: list[int]) -> str:
    text = b"".join(VOCAB[i] for i in ids).decode("utf-8", errors="replace").replace("\u2581", " ")
    return text[1:] if text.startswith(" ") else text


def stream(matcher: StopStringMatcher, deltas: list[str]) -> tuple[list[str], str]:
    out = [matcher.feed(d) for d in deltas]
    return out, "".join(out) + ("" if matcher.stopped else matcher.flush())


def test_detokenizer_holds_incomplete_utf8_and_keeps_leading_spaces():
    detok = IncrementalDetokenizer(toy_decode, context_ids=[0])  # prompt "Hello"
    deltas = [detok.add(t) for t in [1, 5, 2, 3, 4]]
    assert deltas == [" world", " caf", "", "é", "!"]
    assert detok.flush() == ""


def test_detokenizer_flush_emits_a_dangling_partial_character():
    detok = IncrementalDetokenizer(toy_decode)
    assert detok.add(0) == "Hello"
    assert detok.add(2) == ""
    assert detok.flush() == "\ufffd"


@pytest.mark.parametrize("chunks", [[[1, 5, 2, 3, 4, 7]], [[1], [5, 2], [3, 4, 7]], [[t] for t in [1, 5, 2, 3, 4, 7]]])
def test_output_text_does_not_depend_on_chunking(chunks):
    out = OutputText(toy_decode, [0], stops=())
    text = "".join(out.add_tokens(c) for c in chunks) + out.finish()
    assert text == " world café! again" == out.text
    assert out.num_tokens == 6


def test_stop_string_is_cut_and_not_included():
    matcher = StopStringMatcher(["STOP"])
    out, text = stream(matcher, ["abc ST", "OP def"])
    assert text == "abc " and matcher.stopped
    assert out == ["abc ", ""]  # "ST" was held back, never emitted


def test_partial_stop_prefix_is_released_when_it_does_not_complete():
    matcher = StopStringMatcher(["STOP"])
    out, text = stream(matcher, ["abc ST", "ay", " S"])
    assert out == ["abc ", "STay", " "]
    assert text == "abc STay S" and not matcher.stopped


def test_the_first_stop_string_to_complete_wins():
    matcher = StopStringMatcher(["world", "lo w"])
    _, text = stream(matcher, ["hel", "lo world"])
    assert text == "hel"
    # "bc" is complete before "abcd" is: generation stops there, whatever the delta boundaries
    for deltas in (["xabcd"], ["xa", "bcd"], list("xabcd")):
        assert stream(StopStringMatcher(["abcd", "bc"]), deltas)[1] == "xa"
    # same end character: cut at the earliest start
    assert stream(StopStringMatcher(["cd", "bcd"]), ["abcde"])[1] == "a"


def test_self_overlapping_stop_strings():
    assert stream(StopStringMatcher(["aab"]), ["aa", "aab"])[1] == "aa"
    assert stream(StopStringMatcher(["abab"]), ["aba", "bab"])[1] == ""
    out, text = stream(StopStringMatcher(["abac"]), ["ab", "ab", "ab", "x"])
    assert text == "abababx" and out == ["", "ab", "ab", "abx"]


def test_long_stop_strings_are_linear_time():
    matcher = StopStringMatcher(["a" * 20000 + "b"])
    out = [matcher.feed("a" * 100) for _ in range(300)]
    assert "".join(out) == "a" * 10000  # the last 20000 "a"s could still start the stop string
    assert matcher.flush() == "a" * 20000


def test_stop_string_spanning_many_deltas():
    matcher = StopStringMatcher(["\n\nThe end"])
    _, text = stream(matcher, ["story.", "\n", "\nThe", " e", "nd and more"])
    assert text == "story."


def test_output_text_counts_tokens_up_to_the_stop():
    out = OutputText(toy_decode, [0], stops=["STOP"])
    text = out.add_tokens([1, 8, 9, 4, 4])  # " world" "S" "TOP" -> stop at the third token
    assert out.stopped and out.num_tokens == 3
    assert text + out.finish() == " world"


def test_empty_stop_string_is_rejected():
    with pytest.raises(ValueError):
        StopStringMatcher(["ok", ""])
