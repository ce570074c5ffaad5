"""Structured output: grammars that constrain what the target may emit (JSON schemas, regular expressions,
choices, EBNF, tool-call formats), described as :mod:`draftwise.structured.spec` values and compiled by a
grammar engine into per-request logits processors."""
