"""Tokenizer compatibility checks: identical tables, real mismatches (named), padded vocabularies, special
tokens and chat templates, GGUF vs Hugging Face sources, and the real SmolLM2-vs-Qwen family mismatch."""

from __future__ import annotations

import pytest

from draftwise.builder import TokenizerMismatchError, check_same_tokenizer
from draftwise.check.describe import describe_gguf
from draftwise.check.gguf_header import read_gguf_header
from draftwise.check.tokenizer import (
    TokenizerInfo,
    compare_tokenizers,
    require_compatible,
    tokenizer_info_from_gguf,
    tokenizer_info_from_hf,
)
from draftwise.models.loading import LoadedModel
from test_check_support import padded_copy, word_tokenizer

from conftest import pulled_model_path, tiny_llama

# In the user's models directory (the session's DRAFTWISE_HOME is a temporary one, without models).
QWEN_GGUF = pulled_model_path("qwen2.5-coder-0.5b")
SMOLLM_GGUF = pulled_model_path("smollm2-135m")


def info(tokens, **specials) -> TokenizerInfo:
    return TokenizerInfo(tokens=tuple(tokens), **specials)


def test_identical_tables_pass_without_findings():
    table = info(["<s>", "</s>", "a", "b"], bos_token_id=0, eos_token_id=1)
    report = compare_tokenizers(table, table, target_vocab_width=4, draft_vocab_width=4)
    assert report.ok and not report.errors and not report.warnings and not report.padded_vocab


def test_mismatch_names_the_first_differing_tokens():
    target = info(["<s>", "</s>", "a", "b", "c", "d"])
    draft = info(["<s>", "</s>", "a", "x", "c", "y"])
    report = compare_tokenizers(target, draft, target_name="big", draft_name="small")
    assert not report.ok and report.num_differing == 2
    assert report.first_differences == [{"id": 3, "target": "b", "draft": "x"}, {"id": 5, "target": "d", "draft": "y"}]
    message = report.errors[0]
    assert "'small'" in message and "'big'" in message and "2 of 6 shared ids differ" in message
    assert "id 3: target 'b' vs draft 'x'" in message
    with pytest.raises(TokenizerMismatchError, match="id 3: target 'b' vs draft 'x'"):
        require_compatible(report)


def test_padded_vocabulary_is_accepted():
    """Same real tokens, target embedding wider (Qwen2-72B 152064 vs Qwen2-1.5B 151936)."""
    table = info([f"t{i}" for i in range(100)])
    report = compare_tokenizers(table, table, target_vocab_width=128, draft_vocab_width=104)
    assert report.ok and report.padded_vocab and not report.warnings
    assert "padded vocabulary" in report.notes[0]


def test_draft_embedding_narrower_than_the_target_table_is_an_error():
    table = info([f"t{i}" for i in range(100)])
    report = compare_tokenizers(table, table, target_vocab_width=128, draft_vocab_width=64)
    assert not report.ok and "could not read every token" in report.errors[0]


def test_specials_and_chat_template_differences_are_warnings():
    target = info(["<s>", "</s>", "<|im_end|>", "a"], bos_token_id=0, eos_token_id=2, chat_template="T")
    draft = info(["<s>", "</s>", "<|im_end|>", "a"], bos_token_id=0, eos_token_id=1, chat_template="D")
    report = compare_tokenizers(target, draft)
    assert report.ok
    assert report.special_tokens["eos"] == {"target_id": 2, "target": "<|im_end|>", "draft_id": 1, "draft": "</s>",
                                            "match": False}
    assert report.special_tokens["bos"]["match"]
    assert report.chat_template_match is False
    assert any(w.startswith("EOS differs") for w in report.warnings)
    assert any("chat templates differ" in w for w in report.warnings)


def test_extra_tokens_on_one_side_are_a_warning():
    report = compare_tokenizers(info(["a", "b", "c", "d"]), info(["a", "b"]))
    assert report.ok and "the target has 2 tokens the draft lacks (ids 2..3" in report.warnings[0]


def test_trailing_placeholders_are_not_real_tokens():
    tokenizer = word_tokenizer(8)
    tokenizer.add_tokens(["[PAD8]", "[PAD9]"])
    assert len(tokenizer_info_from_hf(tokenizer).tokens) == 8


def test_hf_tokenizer_info_reads_table_and_specials():
    table = tokenizer_info_from_hf(word_tokenizer(8, chat_template="{{ messages }}"))
    assert table.tokens == ("<s>", "</s>", "<unk>", "w3", "w4", "w5", "w6", "w7")
    assert (table.bos_token_id, table.eos_token_id, table.pad_token_id) == (0, 1, 0)
    assert table.chat_template == "{{ messages }}"


def test_gguf_table_matches_the_loaded_tokenizer(stories, stories_path):
    """The header-only table (used before loading) equals the table of the tokenizer the model loads with."""
    header = read_gguf_header(stories_path)
    from_header = tokenizer_info_from_gguf(header)
    assert from_header.tokens == tokenizer_info_from_hf(stories.tokenizer).tokens
    assert len(from_header.tokens) == 512
    assert from_header.pad_token_id is None  # the file stores 2**32 - 1: unset


def test_builder_check_accepts_a_padded_pair_and_rejects_a_renamed_table():
    draft_model = tiny_llama(seed=3)
    target = LoadedModel(backend=type(draft_model)(padded_copy(draft_model.model, 128)), tokenizer=word_tokenizer(),
                         name="target")
    draft = LoadedModel(backend=draft_model, tokenizer=word_tokenizer(), name="draft")
    check_same_tokenizer(target, draft)  # padded: accepted
    other = LoadedModel(backend=draft_model, tokenizer=word_tokenizer(renamed={7: "seven"}), name="other")
    with pytest.raises(TokenizerMismatchError, match="id 7: target 'w7' vs draft 'seven'"):
        check_same_tokenizer(target, other)


@pytest.mark.skipif(not (QWEN_GGUF.is_file() and SMOLLM_GGUF.is_file()),
                    reason="needs `draftwise pull qwen2.5-coder-0.5b smollm2-135m`")
def test_smollm2_draft_for_a_qwen_target_fails_readably():
    """Different families: the check fails from the GGUF headers alone, naming the first differing tokens."""
    target, draft = describe_gguf(QWEN_GGUF, "qwen2.5-coder-0.5b"), describe_gguf(SMOLLM_GGUF, "smollm2-135m")
    report = compare_tokenizers(target.tokenizer, draft.tokenizer, target_vocab_width=target.vocab_width,
                                draft_vocab_width=draft.vocab_width, target_name=target.name, draft_name=draft.name)
    assert not report.ok and report.num_differing > 40_000
    assert report.first_differences[0] == {"id": 0, "target": "!", "draft": "<|endoftext|>"}
    assert report.errors == [
        "draft 'smollm2-135m' and target 'qwen2.5-coder-0.5b' use different tokenizers "
        f"({report.num_differing} of 49152 shared ids differ; first: id 0: target '!' vs draft '<|endoftext|>', "
        "id 1: target '\"' vs draft '<|im_start|>', id 2: target '#' vs draft '<|im_end|>'); a draft must share "
        "the target's tokenizer: pick a draft of the target's family, or use n-gram speculation, which needs no draft"
    ]
