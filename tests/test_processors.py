"""The per-request processor chain under speculation: a row processed with a draft path gets exactly the mask
of the committed tokens plus that path applied one token at a time, for chains and DFS-ordered trees; only
committed tokens move the state; ``valid_prefix`` / ``forced_tokens`` / ``is_finished`` / stop tokens follow
the grammar. Grammars come from :mod:`draftwise.structured.grammar` on stories260K's real tokenizer and on a
tiny hand-made vocabulary (for exact forced-token cases)."""

from __future__ import annotations

import random

import pytest
import torch

from draftwise.processors.base import LogitsProcessor, ProcessorChain, RefusedTokenError
from draftwise.structured.grammar import GrammarCompiler, TokenVocabulary
from draftwise.structured.spec import Choice, JsonSchema, Literal, Regex

TOOL_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"const": "get_weather"},
        "arguments": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                                       "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                      "required": ["city", "days"], "additionalProperties": False},
    },
    "required": ["name", "arguments"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def stories_compiler(stories):
    """A grammar compiler for stories260K's tokenizer (512 tokens, SentencePiece byte fallback)."""
    vocabulary = TokenVocabulary.from_huggingface(stories.tokenizer, stop_token_ids=stories.eos_token_ids,
                                                  vocab_size=stories.backend.vocab_size)
    return GrammarCompiler(vocabulary)


def tiny_compiler(pieces: list[bytes]) -> GrammarCompiler:
    """A compiler over ``[b"" (stop, id 0)] + pieces``: token i + 1 is ``pieces[i]``."""
    return GrammarCompiler(TokenVocabulary.from_token_bytes([b""] + pieces, stop_token_ids=[0], name="tiny"))


def allowed(processor: LogitsProcessor, paths, width: int) -> torch.Tensor:
    """``[n_rows, width]`` bool: which tokens each row allows after ``processor.apply`` on zero logits."""
    logits = torch.zeros(len(paths), width)
    processor.apply(logits, paths)
    assert not torch.isnan(logits).any()
    return torch.isfinite(logits)


def one_by_one(compiler: GrammarCompiler, spec, committed, path, width: int) -> torch.Tensor:
    """The reference row: a fresh processor that commits ``committed`` and the admitted prefix of ``path``
    one token at a time, then masks one row."""
    processor = compiler.processor(spec)
    processor.accept(committed)
    for token in path:
        if processor.valid_prefix([token]) == 0:
            break
        processor.accept([token])
    return allowed(processor, [()], width)[0]


def sample_valid(processor: LogitsProcessor, n: int, width: int, rng: random.Random) -> list[int]:
    """``n`` tokens drawn uniformly among those allowed, along the path (the processor's state is unchanged)."""
    path: list[int] = []
    for _ in range(n):
        choices = torch.nonzero(allowed(processor, [tuple(path)], width)[0]).flatten().tolist()
        path.append(rng.choice(choices))
    return path


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_chain_rows_equal_applying_tokens_one_by_one(stories_compiler, stories, seed):
    rng = random.Random(seed)
    width = stories.backend.vocab_size + 3  # padded columns are masked too
    spec = JsonSchema(TOOL_SCHEMA)
    processor = stories_compiler.processor(spec)
    committed: list[int] = []
    for _ in range(4):
        drafts = sample_valid(processor, 6, width, rng)
        drafts[4] = rng.randrange(stories.backend.vocab_size)  # maybe refused: rows 5 and 6 go through it
        paths = [tuple(drafts[:i]) for i in range(len(drafts) + 1)]
        rows = allowed(processor, paths, width)
        for path, row in zip(paths, rows):
            expected = one_by_one(stories_compiler, spec, committed, path, width)
            assert torch.equal(row, expected), path
            assert row.any() and not row[stories.backend.vocab_size:].any()
        n = processor.valid_prefix(drafts)
        processor.accept(drafts[:n])
        committed += drafts[:n]


def test_tree_rows_in_dfs_order_equal_applying_tokens_one_by_one(stories_compiler, stories):
    rng = random.Random(7)
    width = stories.backend.vocab_size
    spec = JsonSchema(TOOL_SCHEMA)
    processor = stories_compiler.processor(spec)
    committed = sample_valid(processor, 5, width, rng)
    processor.accept(committed)

    def children(path):  # two admitted tokens and one random (usually refused) token per node
        choices = torch.nonzero(allowed(processor, [path], width)[0]).flatten().tolist()
        return rng.sample(choices, min(2, len(choices))) + [rng.randrange(width)]

    paths: list[tuple[int, ...]] = []

    def dfs(path, depth):
        paths.append(path)
        if depth < 3:
            for token in children(path):
                dfs(path + (token,), depth + 1)

    dfs((), 0)
    before = allowed(processor, [()], width)[0]
    rows = allowed(processor, paths, width)
    for path, row in zip(paths, rows):
        assert torch.equal(row, one_by_one(stories_compiler, spec, committed, path, width)), path
    assert torch.equal(allowed(processor, [()], width)[0], before)  # speculative rows left no trace
    assert processor.num_committed == len(committed)


def test_accept_moves_the_state_and_a_refused_commit_raises(stories_compiler, stories):
    width = stories.backend.vocab_size
    processor = stories_compiler.processor(JsonSchema(TOOL_SCHEMA))
    path = sample_valid(processor, 5, width, random.Random(3))
    expected = allowed(processor, [tuple(path)], width)[0]
    processor.accept(path)
    assert torch.equal(allowed(processor, [()], width)[0], expected)
    refused = int(torch.nonzero(~expected).flatten()[0])
    assert processor.valid_prefix([refused]) == 0
    with pytest.raises(RefusedTokenError, match="refused committed token"):
        processor.accept([refused])


def test_valid_prefix_cuts_at_the_first_refused_token_and_keeps_the_state(stories_compiler, stories):
    width = stories.backend.vocab_size
    processor = stories_compiler.processor(JsonSchema(TOOL_SCHEMA))
    path = sample_valid(processor, 6, width, random.Random(4))
    refused = int(torch.nonzero(~allowed(processor, [tuple(path[:3])], width)[0]).flatten()[0])
    assert processor.valid_prefix(path) == 6
    assert processor.valid_prefix(path[:3] + [refused] + path[3:]) == 3
    assert processor.valid_prefix([]) == 0
    assert processor.num_committed == 0 and processor.valid_prefix(path) == 6


def test_stop_tokens_are_allowed_exactly_where_the_grammar_may_end():
    compiler = tiny_compiler([b"a", b"b", b"ab"])
    a, b, ab, stop = 1, 2, 3, 0
    processor = compiler.processor(Regex("ab(ab)?"))
    rows = allowed(processor, [(), (a,), (a, b), (ab,), (ab, ab)], 4)
    assert rows[:, stop].tolist() == [False, False, True, True, True]
    assert rows[4].tolist() == [True, False, False, False]  # the grammar must end: only the stop token
    assert processor.valid_prefix([ab, stop, a]) == 2  # nothing after a stop token
    processor.accept([ab])
    assert not processor.is_finished  # "ab" may still continue
    processor.accept([ab])
    assert processor.is_finished
    processor.accept([stop])
    assert processor.is_finished and allowed(processor, [()], 4)[0].tolist() == [True, False, False, False]


def test_forced_tokens_are_the_only_allowed_token_at_each_position():
    compiler = tiny_compiler([b"{", b"}", b'"', b"k", b"e", b"y", b"ke", b":", b" ", b"1", b"2"])
    processor = compiler.processor(JsonSchema({"type": "object", "properties": {"key": {"type": "integer"}},
                                               "required": ["key"], "additionalProperties": False}))
    forced = processor.forced_tokens(10)
    # '{', '"', then "k" or "ke": the key is forced as text but not as tokens; stop there
    assert forced == [1, 3]
    assert processor.forced_tokens(1) == [1]
    rows = allowed(processor, [tuple(forced[:i]) for i in range(len(forced))], 12)
    assert rows.sum(dim=1).tolist() == [1] * len(forced)
    assert processor.jump_forward_tokens(10)[:3] == [1, 3, 7]  # longest match: '{', '"', "ke", ...
    processor.accept(forced + [7, 6])
    assert processor.forced_tokens(10) == [3, 8, 9]  # '"', ':', ' '
    assert processor.num_committed == 4


def test_forced_tokens_on_a_schema_with_fixed_keys_spell_the_keys(stories_compiler, stories):
    """On a real vocabulary a fixed key has several spellings, so few tokens are strictly forced; the
    jump-forward draft spells the forced text, and every token of both is admitted."""
    decoded = stories_compiler.vocabulary.info.decoded_vocab
    processor = stories_compiler.processor(JsonSchema(TOOL_SCHEMA))
    forced = processor.forced_tokens(16)
    width = stories.backend.vocab_size
    rows = allowed(processor, [tuple(forced[:i]) for i in range(len(forced))], width)
    assert rows.sum(dim=1).tolist() == [1] * len(forced)
    jump = processor.jump_forward_tokens(64)
    assert processor.valid_prefix(jump) == len(jump)
    text = b"".join(decoded[token] for token in jump)
    assert text == b'{"name": "get_weather", "arguments": {"city": "'


def test_padded_columns_are_masked_and_bad_shapes_are_refused(stories_compiler, stories):
    vocab = stories.backend.vocab_size
    processor = stories_compiler.processor(JsonSchema(None))
    rows = allowed(processor, [()], vocab + 64)
    assert rows[0, :vocab].any() and not rows[0, vocab:].any()
    with pytest.raises(ValueError, match="fewer than"):
        processor.apply(torch.zeros(1, vocab - 1), [()])
    with pytest.raises(ValueError, match="one row per path"):
        processor.apply(torch.zeros(2, vocab), [()])


class BanToken(LogitsProcessor):
    """A test processor: forbids one token at every position (what ``logit_bias: -100`` does)."""

    def __init__(self, token: int) -> None:
        self.token = token
        self.committed: list[int] = []

    def apply(self, logits, paths):
        logits[:, self.token] = float("-inf")

    def accept(self, tokens):
        if self.token in tokens:
            raise RefusedTokenError(f"banned token {self.token} committed")
        self.committed += tokens

    def valid_prefix(self, tokens):
        return list(tokens).index(self.token) if self.token in tokens else len(tokens)


def test_chain_applies_in_order_and_combines_prefixes_and_offers():
    compiler = tiny_compiler([b"a", b"b", b"ab"])
    grammar = compiler.processor(Choice(("ab", "ba")))
    chain = ProcessorChain([grammar, BanToken(3)])
    rows = allowed(chain, [(), (1,)], 4)
    assert rows.tolist() == [[False, True, True, False], [False, False, True, False]]
    assert chain.valid_prefix([3]) == 0 and chain.valid_prefix([1, 2]) == 2 and chain.valid_prefix([1, 1]) == 1
    chain.accept([1])
    assert chain.forced_tokens(4) == [2] and chain.jump_forward_tokens(4) == [2]
    assert not chain.is_finished
    chain.accept([2])
    assert chain.is_finished
    empty = ProcessorChain()
    logits = torch.randn(2, 4)
    kept = logits.clone()
    empty.apply(logits, [(), (1,)])
    assert torch.equal(logits, kept) and not empty and empty.valid_prefix([1, 2, 3]) == 3


def test_jump_forward_is_cut_by_every_processor_in_the_chain():
    compiler = tiny_compiler([b"x", b"y", b"z"])
    chain = ProcessorChain([compiler.processor(Literal("xyz")), BanToken(3)])
    assert chain.jump_forward_tokens(8) == [1, 2]
    assert chain.forced_tokens(8) == [1, 2]
