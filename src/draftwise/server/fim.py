"""Fill-in-the-middle prompts: ``suffix`` on ``/v1/completions``, for models trained on FIM tokens.

A code model trained for fill-in-the-middle reads the text before the cursor and the text after it, each behind
a special token, and writes the middle. The three formats recognised, all in prefix-suffix-middle order:

- Qwen2.5-Coder: ``<|fim_prefix|>`` prefix ``<|fim_suffix|>`` suffix ``<|fim_middle|>`` (its model card);
- StarCoder / SantaCoder: ``<fim_prefix>`` prefix ``<fim_suffix>`` suffix ``<fim_middle>`` (Bavarian et al.
  2022, "Efficient Training of Language Models to Fill in the Middle", as StarCoder's paper trains it);
- CodeLlama: ``<PRE>`` prefix ``<SUF>`` suffix ``<MID>`` (SentencePiece writes them ``▁<PRE>`` and so on), after
  the BOS token its tokenizer adds (Rozière et al. 2023, "Code Llama").

The special tokens are found in the tokenizer's vocabulary and placed as single ids, never as the BPE of their
text (which a model was not trained on and a tokenizer may split).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

__all__ = ["FimFormat", "FIM_FORMATS", "MIDDLE_END_TOKENS", "detect_fim"]


@dataclass(frozen=True)
class FimFormat:
    """One model's fill-in-the-middle tokens (ids in its vocabulary).

    Attributes:
        name: ``"qwen"``, ``"starcoder"`` or ``"codellama"``.
        prefix_id, suffix_id, middle_id: the ids of the tokens before the prefix, the suffix and the middle.
        bos_ids: ids that open the prompt (the tokenizer's BOS where it adds one: CodeLlama), else ``()``.
        stop_ids: ids that end the middle: the three FIM tokens and the vocabulary's end-of-text and file tokens
            (:data:`MIDDLE_END_TOKENS`). A FIM-trained model writes ``<|endoftext|>`` after the middle, which a
            chat model's EOS (``<|im_end|>``) does not cover, and generation would run on past the middle.
    """

    name: str
    prefix_id: int
    suffix_id: int
    middle_id: int
    bos_ids: tuple[int, ...] = ()
    stop_ids: tuple[int, ...] = ()

    def prompt_ids(self, prefix_ids: Sequence[int], suffix_ids: Sequence[int]) -> list[int]:
        """The prompt in prefix-suffix-middle order: ``bos, PRE, prefix, SUF, suffix, MID`` (``prefix_ids`` and
        ``suffix_ids``: the two texts' ids without special tokens); the model's output is the middle."""
        return [*self.bos_ids, self.prefix_id, *prefix_ids, self.suffix_id, *suffix_ids, self.middle_id]


#: name -> (prefix, suffix, middle) token strings as each family's vocabulary spells them (first match wins)
FIM_FORMATS: dict[str, tuple[tuple[str, str, str], ...]] = {
    "qwen": (("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"),),
    "starcoder": (("<fim_prefix>", "<fim_suffix>", "<fim_middle>"), ("<fim-prefix>", "<fim-suffix>", "<fim-middle>")),
    "codellama": (("▁<PRE>", "▁<SUF>", "▁<MID>"), ("<PRE>", "<SUF>", "<MID>")),
}

#: Tokens that end a FIM middle where the vocabulary has them (Qwen2.5-Coder, StarCoder, CodeLlama's ``<EOT>``).
MIDDLE_END_TOKENS = ("<|endoftext|>", "<|fim_pad|>", "<|file_sep|>", "<|repo_name|>", "<file_sep>", "<EOT>",
                     "▁<EOT>")


def detect_fim(vocabulary: Mapping[str, int], bos_id: int | None = None) -> FimFormat | None:
    """The FIM format whose three tokens ``vocabulary`` (token string -> id, a tokenizer's ``get_vocab()``) holds,
    or None. ``bos_id``: the BOS id the tokenizer adds to a prompt (None: it adds none); CodeLlama's prompt opens
    with it."""
    for name, spellings in FIM_FORMATS.items():
        for spelling in spellings:
            ids = [vocabulary.get(token) for token in spelling]
            if all(i is not None for i in ids):
                bos = (bos_id,) if name == "codellama" and bos_id is not None else ()
                ends = [vocabulary[token] for token in MIDDLE_END_TOKENS if token in vocabulary]
                stops = tuple(dict.fromkeys([*ids, *ends]))
                return FimFormat(name, ids[0], ids[1], ids[2], bos, stops)
    return None
