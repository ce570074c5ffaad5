"""Shared helpers (no tests) for the ``draftwise check`` tests: word-level tokenizers with chosen tables,
tiny Llama models saved as Hugging Face directories, and a padded-vocabulary copy of a model."""

from __future__ import annotations

import copy
from pathlib import Path

import torch

from conftest import tiny_llama


def word_tokenizer(vocab_size: int = 96, renamed: dict[int, str] | None = None, chat_template: str | None = None):
    """A ``PreTrainedTokenizerFast`` over ``<s>``, ``</s>``, ``<unk>``, ``w3`` ... ``w{vocab_size - 1}``
    (whitespace-split words); ``renamed`` replaces the token at some ids."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    names = ["<s>", "</s>", "<unk>"] + [f"w{i}" for i in range(3, vocab_size)]
    for token_id, name in (renamed or {}).items():
        names[token_id] = name
    tokenizer = Tokenizer(models.WordLevel({name: i for i, name in enumerate(names)}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    wrapped = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>",
                                      unk_token="<unk>", pad_token="<s>")
    if chat_template:
        wrapped.chat_template = chat_template
    return wrapped


def padded_copy(model: torch.nn.Module, width: int) -> torch.nn.Module:
    """The same model with its embedding and LM head widened to ``width`` rows (a padded vocabulary).

    The new LM-head rows copy row 0, so their logits tie with id 0's and greedy argmax (which returns the
    first maximum) never picks them: the padded model's greedy output equals the original's.
    """
    padded = copy.deepcopy(model)
    old = padded.get_output_embeddings().weight.shape[0]
    padded.resize_token_embeddings(width, mean_resizing=False)
    with torch.no_grad():
        padded.get_output_embeddings().weight[old:] = padded.get_output_embeddings().weight[0]
    return padded.eval()


def save_hf_model(model: torch.nn.Module, tokenizer, directory: Path) -> Path:
    """Save a model and tokenizer as a Hugging Face directory; returns it."""
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def tiny_pair_dirs(root: Path, *, padded_width: int | None = None, draft_tokenizer=None) -> tuple[Path, Path]:
    """A (target, draft) pair of tiny Llama directories sharing a 96-token word tokenizer.

    The draft is a random tiny Llama; the target is the same model (``padded_width``: with a widened
    vocabulary, see :func:`padded_copy`). ``draft_tokenizer`` overrides the draft's tokenizer.
    """
    tokenizer = word_tokenizer()
    draft_model = tiny_llama(seed=3).model
    target_model = padded_copy(draft_model, padded_width) if padded_width else draft_model
    target = save_hf_model(target_model, tokenizer, root / "target")
    draft = save_hf_model(draft_model, draft_tokenizer or tokenizer, root / "draft")
    return target, draft
