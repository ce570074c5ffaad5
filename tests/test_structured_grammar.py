"""GrammarSpec compilation (:mod:`draftwise.structured.grammar`): every node type on a byte vocabulary, clear
errors, the bounded per-tokenizer cache; and constrained decoding with stories260K's real logits: greedy
output under a JSON-schema mask always parses and validates, and speculative verification with masked rows
(K in {1, 4, 8}, drafts cut by ``valid_prefix``) gives exactly the output of one row at a time."""

from __future__ import annotations

import json
import random

import pytest
import torch

from conftest import pulled_model_path
from draftwise.structured.grammar import GrammarCompiler, GrammarError, TokenVocabulary, spec_key
from draftwise.structured.spec import (
    Alternatives, Choice, Concat, Ebnf, JsonSchema, Literal, Regex, Repeat,
)

STOP = 256


@pytest.fixture(scope="module")
def byte_compiler() -> GrammarCompiler:
    """A compiler over a byte vocabulary: token i < 256 is byte i, token 256 the stop token."""
    return GrammarCompiler(TokenVocabulary.from_token_bytes([bytes([i]) for i in range(256)] + [b""],
                                                            stop_token_ids=[STOP], name="bytes"))


def matches(compiler: GrammarCompiler, spec, text: str) -> bool:
    """True when ``text`` is a complete sentence of ``spec`` (its bytes then the stop token are admitted)."""
    tokens = list(text.encode()) + [STOP]
    return compiler.processor(spec).valid_prefix(tokens) == len(tokens)


TOOL = {"type": "object", "properties": {"name": {"const": "f"}, "arguments": {"type": "object"}},
        "required": ["name", "arguments"]}

CASES = [
    (Literal('say "hi"\n\té'), ['say "hi"\n\té'], ['say "hi"', 'say "hi"\n\té!']),
    (Literal(""), [""], ["a"]),
    (JsonSchema(None), ['{"a": [1, 2.5, null]}', "{}"], ["[1]", '"x"', '{"a": 1'] ),
    (JsonSchema({"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}),
     ['{"n": 5}'], ['{"n": "5"}', "{}", '{"n": 5, "m": 1}']),
    (JsonSchema({"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}, strict=False),
     ['{"n": 5}', '{"n": 5, "m": 1}'], ["{}"]),
    (Regex(r"[a-c]{2}\d"), ["ab7"], ["ab", "abc", "ab77"]),
    (Choice(("yes", "no")), ["yes", "no"], ["y", "yesno", "maybe"]),
    (Ebnf('root ::= "x" [0-9]+'), ["x1", "x123"], ["x", "1"]),
    (Concat((Literal("<tool_call>\n"), JsonSchema(TOOL), Literal("\n</tool_call>"))),
     ['<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>'],
     ['{"name": "f", "arguments": {}}', '<tool_call>\n{"name": "g", "arguments": {}}\n</tool_call>']),
    (Alternatives((Literal("none"), Regex("[0-9]+"))), ["none", "42"], ["none42", "x"]),
    (Repeat(Choice(("a", "b")), 2, 3, ", "), ["a, b", "a, b, a"], ["a", "a, b, a, b", "ab", "a,b"]),
    (Repeat(Literal("x"), 0, None), ["", "x", "xxxx"], ["y"]),
    (Repeat(Literal("x"), 1, 1, ";"), ["x"], ["", "x;x"]),
    (Repeat(Concat((Literal("<tool_call>\n"), JsonSchema(TOOL), Literal("\n</tool_call>"))), 1, None, "\n"),
     ['<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>\n<tool_call>\n{"name": "f", "arguments": '
      '{"x": 1}}\n</tool_call>'], ["", '<tool_call>\n{"name": "f"}\n</tool_call>']),
]


@pytest.mark.parametrize(("spec", "good", "bad"), CASES, ids=[type(case[0]).__name__ for case in CASES])
def test_every_spec_node_admits_its_sentences_only(byte_compiler, spec, good, bad):
    for text in good:
        assert matches(byte_compiler, spec, text), text
    for text in bad:
        assert not matches(byte_compiler, spec, text), text


@pytest.mark.parametrize(("spec", "kind"), [
    (JsonSchema({"type": "objekt"}), "json_schema"),
    (JsonSchema({"$ref": "#/definitions/missing"}), "json_schema"),
    (Regex("(ab"), "regex"),
    (Ebnf("root ::= undefined_rule"), "ebnf"),
    (Choice(()), "choice"),
    (Concat(()), "concat"),
    (Alternatives(()), "alternatives"),
    (Repeat(Literal("a"), 3, 1), "repeat"),
    (Concat((Literal("x"), Regex("[z-a]"))), "regex"),
])
def test_invalid_specs_raise_a_value_error_naming_the_node(byte_compiler, spec, kind):
    with pytest.raises(GrammarError) as caught:
        byte_compiler.compile(spec)
    assert isinstance(caught.value, ValueError) and caught.value.kind == kind
    assert str(caught.value).startswith(f"invalid {kind}: ") and ".cc:" not in str(caught.value)


def test_compiled_grammars_are_cached_per_spec_and_bounded():
    compiler = GrammarCompiler(TokenVocabulary.from_token_bytes([bytes([i]) for i in range(256)] + [b""],
                                                                stop_token_ids=[STOP]), max_entries=2)
    first = compiler.compile(JsonSchema({"type": "object", "properties": {"a": {"type": "string"}, "b": {}}}))
    again = compiler.compile(JsonSchema({"properties": {"b": {}, "a": {"type": "string"}}, "type": "object"}))
    assert again is first and len(compiler) == 1
    compiler.compile(Regex("a+"))
    assert compiler.compile(JsonSchema({"type": "object", "properties": {"a": {"type": "string"}, "b": {}}})) is first
    compiler.compile(Choice(("x",)))  # evicts the least recently used: the regex
    assert len(compiler) == 2
    assert compiler.compile(JsonSchema({"type": "object", "properties": {"a": {"type": "string"}, "b": {}}})) is first
    assert spec_key(Regex("a+")) != spec_key(Literal("a+"))
    assert spec_key(JsonSchema(None)) != spec_key(JsonSchema(None, strict=False))
    with pytest.raises(ValueError):
        GrammarCompiler(compiler.vocabulary, max_entries=0)


# -- constrained decoding with stories260K's real logits --------------------------------------------------

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 10},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "happy": {"type": "boolean"},
        "pets": {"type": "array", "items": {"enum": ["cat", "dog", "fish"]}, "maxItems": 3},
    },
    "required": ["name", "age", "happy", "pets"],
    "additionalProperties": False,
}
CALL = {
    "type": "object",
    "properties": {"name": {"const": "get_weather"},
                   "arguments": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                                  "days": {"type": "integer", "minimum": 1,
                                                                           "maximum": 7}},
                                 "required": ["city", "days"], "additionalProperties": False}},
    "required": ["name", "arguments"],
    "additionalProperties": False,
}
SPECS = {
    "person": (JsonSchema(PERSON), "", "", PERSON),
    "hermes_call": (Concat((Literal("<tool_call>\n"), JsonSchema(CALL), Literal("\n</tool_call>"))),
                    "<tool_call>\n", "\n</tool_call>", CALL),
}
PROMPTS = ["Once upon a time", "Lily wanted to", "The dog"]
MAX_TOKENS = 160


def conforms(value, schema) -> bool:
    """A hand check of the schema keywords used above (jsonschema is not a dependency)."""
    if "const" in schema and value != schema["const"]:
        return False
    if "enum" in schema and value not in schema["enum"]:
        return False
    kind = schema.get("type")
    if kind == "object":
        if not isinstance(value, dict) or any(key not in value for key in schema.get("required", ())):
            return False
        properties = schema.get("properties", {})
        if schema.get("additionalProperties") is False and set(value) - set(properties):
            return False
        return all(conforms(value[key], sub) for key, sub in properties.items() if key in value)
    if kind == "string":
        return isinstance(value, str) and len(value) <= schema.get("maxLength", len(value))
    if kind == "integer":
        return (isinstance(value, int) and not isinstance(value, bool)
                and schema.get("minimum", value) <= value <= schema.get("maximum", value))
    if kind == "boolean":
        return isinstance(value, bool)
    if kind == "array":
        return (isinstance(value, list) and len(value) <= schema.get("maxItems", len(value))
                and all(conforms(item, schema.get("items", {})) for item in value))
    return kind is None


def masked_argmax(processor, logits: torch.Tensor, paths) -> list[int]:
    """Greedy tokens of ``logits`` (``[n_rows, vocab]``) after the processor masks each row for its path."""
    logits = logits.clone()
    processor.apply(logits, paths)
    assert torch.isfinite(logits).any(dim=1).all()
    return logits.argmax(dim=1).tolist()


def decode_speculative(model, compiler, spec, prompt: list[int], k: int, reference: list[int] | None,
                       rng: random.Random) -> list[int]:
    """Greedy constrained decoding with drafts of ``k`` tokens (k = 0: one row at a time), verified in one
    target pass whose rows are masked by the grammar state after the draft tokens before them.

    Drafts alternate between the reference output with one random token changed (long accepted runs) and
    tokens drawn among those the grammar allows (mostly rejected); each is cut by ``valid_prefix``.
    """
    backend, eos = model.backend, set(model.eos_token_ids)
    processor = compiler.processor(spec, stop_token_ids=model.eos_token_ids)
    backend.reset()
    backend.forward(prompt[:-1])
    pending, output = prompt[-1], []
    while len(output) < MAX_TOKENS:
        drafts = propose(processor, k, reference, output, rng, backend.vocab_size) if k else []
        drafts = drafts[: processor.valid_prefix(drafts)]
        base = backend.num_cached
        logits = backend.forward([pending] + drafts).logits  # [1 + len(drafts), vocab]
        greedy = masked_argmax(processor, logits, [tuple(drafts[:i]) for i in range(len(drafts) + 1)])
        accepted = 0
        while accepted < len(drafts) and greedy[accepted] == drafts[accepted]:
            accepted += 1
        new = drafts[:accepted] + [greedy[accepted]]
        backend.rollback(base + 1 + accepted)
        for token in new:
            processor.accept([token])
            output.append(token)
            if token in eos or len(output) == MAX_TOKENS:
                return output
        pending = new[-1]
    return output


def propose(processor, k: int, reference, output: list[int], rng: random.Random, vocab: int) -> list[int]:
    if reference is not None and rng.random() < 0.5:
        drafts = list(reference[len(output): len(output) + k])
        if drafts:
            drafts[rng.randrange(len(drafts))] = rng.randrange(vocab)
        return drafts
    drafts: list[int] = []
    for _ in range(k):
        row = torch.zeros(1, vocab)
        processor.apply(row, [tuple(drafts)])
        drafts.append(rng.choice(torch.nonzero(torch.isfinite(row[0])).flatten().tolist()))
    return drafts


@pytest.fixture(scope="module")
def stories_grammars(stories):
    return GrammarCompiler(TokenVocabulary.from_huggingface(stories.tokenizer, stop_token_ids=stories.eos_token_ids,
                                                            vocab_size=stories.backend.vocab_size))


@pytest.mark.parametrize("name", sorted(SPECS))
def test_greedy_constrained_output_parses_and_validates(stories, stories_grammars, name):
    spec, prefix, suffix, schema = SPECS[name]
    decoded = stories_grammars.vocabulary.info.decoded_vocab
    for text in PROMPTS:
        tokens = decode_speculative(stories, stories_grammars, spec, stories.encode(text), 0, None, random.Random(0))
        assert tokens[-1] in stories.eos_token_ids, f"no stop within {MAX_TOKENS} tokens"
        body = b"".join(decoded[token] for token in tokens[:-1]).decode()
        assert body.startswith(prefix) and body.endswith(suffix), body
        value = json.loads(body[len(prefix): len(body) - len(suffix)])
        assert conforms(value, schema), body


@pytest.mark.parametrize("k", [1, 4, 8])
@pytest.mark.parametrize("name", sorted(SPECS))
def test_masked_verification_rows_give_the_one_row_at_a_time_output(stories, stories_grammars, name, k):
    spec = SPECS[name][0]
    for seed, text in enumerate(PROMPTS):
        prompt = stories.encode(text)
        reference = decode_speculative(stories, stories_grammars, spec, prompt, 0, None, random.Random(seed))
        speculative = decode_speculative(stories, stories_grammars, spec, prompt, k, reference, random.Random(seed))
        assert speculative == reference


# -- Qwen2.5's vocabulary (151,643 BPE tokens + specials) -------------------------------------------------

QWEN_GGUFS = [pulled_model_path(name) for name in ("qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b")]


@pytest.fixture(scope="module")
def qwen_tokenizer():
    path = next((p for p in QWEN_GGUFS if p.is_file()), None)
    if path is None:
        pytest.skip("no Qwen2.5 GGUF pulled (draftwise pull qwen2.5-coder-0.5b)")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


@pytest.mark.slow
def test_hermes_tool_call_on_the_qwen_vocabulary(qwen_tokenizer):
    """The Hermes format's ``<tool_call>`` is one special token in Qwen's vocabulary: the grammar admits it,
    the canonical tokenization of a whole call, and ``<|im_end|>`` only after ``</tool_call>``."""
    stops = [qwen_tokenizer.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>")]
    compiler = GrammarCompiler(TokenVocabulary.from_huggingface(qwen_tokenizer, stop_token_ids=stops,
                                                                vocab_size=151936))
    spec = Concat((Literal("<tool_call>\n"), JsonSchema(CALL), Literal("\n</tool_call>")))
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>'
    tokens = qwen_tokenizer.encode(text, add_special_tokens=False)
    assert tokens[0] == qwen_tokenizer.convert_tokens_to_ids("<tool_call>")
    processor = compiler.processor(spec)
    assert processor.valid_prefix(tokens + [stops[0]]) == len(tokens) + 1
    assert processor.valid_prefix(tokens[:-1] + [stops[0]]) == len(tokens) - 1
    jump = processor.jump_forward_tokens(64)
    assert qwen_tokenizer.decode(jump).startswith('<tool_call>\n{"name": "get_weather", "arguments": {"city":')
    processor.accept(tokens)
    logits = torch.zeros(1, 151936)
    processor.apply(logits, [()])
    assert sorted(torch.nonzero(torch.isfinite(logits[0])).flatten().tolist()) == sorted(stops)
    assert processor.is_finished


def test_a_gguf_token_table_gives_the_vocabulary_of_the_huggingface_tokenizer(stories, stories_grammars):
    """What llama.cpp's tokenizer offers (``convert_ids_to_tokens``: the GGUF table) decodes to the same bytes
    as the ``transformers`` tokenizer, and masks the same rows."""
    tokenizer = stories.tokenizer
    table = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    from_table = TokenVocabulary.from_token_table(table, stop_token_ids=stories.eos_token_ids,
                                                  vocab_size=stories.backend.vocab_size)
    reference = stories_grammars.vocabulary
    assert from_table.info.vocab_type == reference.info.vocab_type
    assert from_table.info.decoded_vocab == reference.info.decoded_vocab
    assert from_table.stop_token_ids == reference.stop_token_ids
    spec = JsonSchema(PERSON)
    path = decode_speculative(stories, stories_grammars, spec, stories.encode(PROMPTS[0]), 0, None, random.Random(0))
    rows = []
    for compiler in (GrammarCompiler(from_table), stories_grammars):
        logits = torch.zeros(len(path) + 1, stories.backend.vocab_size)
        compiler.processor(spec).apply(logits, [tuple(path[:i]) for i in range(len(path) + 1)])
        rows.append(torch.isfinite(logits))
    assert torch.equal(rows[0], rows[1]) and rows[0].any(dim=1).all()
