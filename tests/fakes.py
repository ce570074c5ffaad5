"""Test doubles: a bigram "model" with exact, batch-invariant logits, a scripted model that behaves by its
prompt (for the server's scheduler), and scripted proposers."""

from __future__ import annotations

import itertools
import threading
from collections.abc import Callable, Sequence

import torch

from draftwise.backends.base import CausalLM, ForwardOutput
from draftwise.config import SamplingParams
from draftwise.proposers.base import DraftProposal, SequenceProposer


class BigramLM(CausalLM):
    """A causal LM whose next-token logits depend only on the last token: ``logits = table[last]``.

    ``table`` is ``[vocab, vocab]``. Its distributions are known exactly, which makes statistical tests of
    the whole engine cheap. Counts forward passes and tokens fed.
    """

    def __init__(self, table: torch.Tensor, max_context: int = 4096, name: str = "bigram") -> None:
        self.table = table.float()
        self.vocab_size = table.shape[0]
        self.max_context = max_context
        self.name = name
        self.tokens: list[int] = []
        self.num_forwards = 0

    @property
    def num_cached(self) -> int:
        return len(self.tokens)

    def forward(self, token_ids, *, num_logits=None, return_hidden=False) -> ForwardOutput:
        token_ids = list(token_ids)
        self._check_forward_args(token_ids)
        self.tokens.extend(token_ids)
        self.num_forwards += 1
        keep = len(token_ids) if num_logits is None else min(num_logits, len(token_ids))
        return ForwardOutput(logits=self.table[torch.tensor(token_ids[-keep:])].clone())

    def rollback(self, length: int) -> None:
        self._check_rollback_args(length)
        del self.tokens[length:]

    supports_tree = True

    def forward_tree(self, token_ids, parents, *, return_hidden=False) -> ForwardOutput:
        """A bigram's row depends only on its own token, so a tree pass is a plain pass over the rows."""
        assert len(parents) == len(token_ids) - 1
        return self.forward(token_ids)

    def compact(self, base: int, keep) -> None:
        tail = self.tokens[base:]
        self.tokens = self.tokens[:base] + [tail[j] for j in keep]


class ScriptedLM(CausalLM):
    """A model that behaves by the prompt of the sequence in its cache, for scheduler tests through the real
    engine: ``rule(prompt)`` gives ``(next token, waits, fails)``. Every pass of a sequence whose prompt
    ``waits`` first waits for :attr:`gate` (60 s at most); one that ``fails`` raises ``RuntimeError("the engine
    broke")``; otherwise every position predicts the next token (one-hot logits). Records each prompt served
    (:attr:`served`, in order).

    Args:
        rule: prompt token ids -> ``(token, waits, fails)``.
        vocab_size: logits width.
    """

    def __init__(self, rule: Callable[[list[int]], tuple[int, bool, bool]], vocab_size: int = 256,
                 max_context: int = 4096, name: str = "scripted") -> None:
        self.rule = rule
        self.vocab_size = vocab_size
        self.max_context = max_context
        self.name = name
        self.gate = threading.Event()
        self.served: list[list[int]] = []
        self.tokens: list[int] = []
        self._prompt: list[int] = []

    @property
    def num_cached(self) -> int:
        return len(self.tokens)

    def forward(self, token_ids, *, num_logits=None, return_hidden=False, hidden_rows=None) -> ForwardOutput:
        token_ids = list(token_ids)
        self._check_forward_args(token_ids)
        if not self.tokens:  # a prefill: a new request
            self._prompt = list(token_ids)
            self.served.append(self._prompt)
        token, waits, fails = self.rule(self._prompt)
        if fails:
            raise RuntimeError("the engine broke")
        if waits:
            assert self.gate.wait(60), "gate never opened"
        self.tokens.extend(token_ids)
        keep = len(token_ids) if num_logits is None else min(num_logits, len(token_ids))
        logits = torch.full((keep, self.vocab_size), -1e9)
        logits[:, token] = 0.0
        return ForwardOutput(logits=logits)

    def rollback(self, length: int) -> None:
        self._check_rollback_args(length)
        del self.tokens[length:]


def peaked_table(vocab: int, seed: int, scale: float = 4.0) -> torch.Tensor:
    """A random ``[vocab, vocab]`` logits table with clear argmaxes."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(vocab, vocab, generator=generator) * scale


class ScriptedProposer(SequenceProposer):
    """Proposes the oracle continuation, but with a wrong token at draft position ``wrong_at`` (0-based)
    of every draft (None: always right). ``oracle`` is the full expected output after the prompt."""

    name = "scripted"

    def __init__(self, prompt_len: int, oracle: Sequence[int], vocab: int, wrong_at: int | None = None,
                 extend: Sequence[int] = ()) -> None:
        self.prompt_len = prompt_len
        self.oracle = list(oracle) + list(extend)
        self.vocab = vocab
        self.wrong_at = wrong_at
        self.calls: list[int] = []

    def propose(self, context_ids, k, params: SamplingParams, generator) -> DraftProposal:
        self.calls.append(k)
        done = len(context_ids) - self.prompt_len
        tokens = self.oracle[done : done + k]
        if self.wrong_at is not None and self.wrong_at < len(tokens):
            tokens[self.wrong_at] = (tokens[self.wrong_at] + 1) % self.vocab
        return DraftProposal(token_ids=tuple(tokens))


class ScriptedTreeProposer(SequenceProposer):
    """Proposes a tree of depth k: ``width`` siblings at every depth below the correct node, the oracle token
    at sibling rank ``rank`` (the others wrong), and no correct child at depth index ``wrong_at`` (0-based;
    None: every depth has one). Exactly ``min(wrong_at, k)`` tokens are accepted per step."""

    name = "scripted-tree"

    def __init__(self, prompt_len: int, oracle: Sequence[int], vocab: int, width: int = 3, rank: int = 1,
                 wrong_at: int | None = None) -> None:
        self.prompt_len, self.oracle, self.vocab = prompt_len, list(oracle), vocab
        self.width, self.rank, self.wrong_at = width, rank, wrong_at

    def propose(self, context_ids, k, params: SamplingParams, generator) -> DraftProposal:
        done = len(context_ids) - self.prompt_len
        truth = self.oracle[done : done + k]
        tokens: list[int] = []
        parents: list[int] = []
        parent = -1
        for depth, right in enumerate(truth):
            siblings = [(right + 1 + j) % self.vocab for j in range(self.width)]  # all wrong
            if depth != self.wrong_at:
                siblings[self.rank % self.width] = right
            first = len(tokens)
            tokens.extend(siblings)
            parents.extend([parent] * self.width)
            parent = first + self.rank % self.width
        return DraftProposal(token_ids=tuple(tokens), parents=tuple(parents) if tokens else None)


def sequence_distribution(table: torch.Tensor, first: int, length: int, temperature: float) -> dict:
    """Exact probability of every length-``length`` continuation of token ``first`` under a bigram table at
    ``temperature`` (the oracle for statistical tests of lossless sampling)."""
    probs = torch.softmax(table / temperature, dim=-1)
    dist = {}
    for seq in itertools.product(range(table.shape[0]), repeat=length):
        p, prev = 1.0, first
        for t in seq:
            p *= float(probs[prev, t])
            prev = t
        dist[seq] = p
    return dist


class ReplyLM(CausalLM):
    """A model that answers each prompt with a scripted reply: ``reply(prompt_ids)`` gives the reply's token ids
    and every position past the prompt predicts the reply's next token (one-hot logits), then ``eos``. A row's
    logits depend only on its position and the prompt, so speculative and plain decoding agree: a fake for
    driving real clients (tool calls, agents) through the real server and engine deterministically.

    Args:
        reply: prompt token ids -> the reply's token ids (without EOS).
        vocab_size: logits width; eos: the token after the reply.
    """

    def __init__(self, reply: Callable[[list[int]], list[int]], vocab_size: int, eos: int,
                 max_context: int = 4096, name: str = "reply") -> None:
        self.reply = reply
        self.vocab_size = vocab_size
        self.eos = eos
        self.max_context = max_context
        self.name = name
        self.tokens: list[int] = []
        self._prompt_len = 0
        self._reply: list[int] = []

    @property
    def num_cached(self) -> int:
        return len(self.tokens)

    def forward(self, token_ids, *, num_logits=None, return_hidden=False, hidden_rows=None) -> ForwardOutput:
        token_ids = list(token_ids)
        self._check_forward_args(token_ids)
        if not self.tokens:  # a new sequence: its first pass holds (the start of) the prompt
            self._prompt_len = -1
        start = len(self.tokens)
        self.tokens.extend(token_ids)
        keep = len(token_ids) if num_logits is None else min(num_logits, len(token_ids))
        logits = torch.full((keep, self.vocab_size), -1e9)
        for row, position in enumerate(range(start + len(token_ids) - keep, start + len(token_ids))):
            logits[row, self._next(position)] = 0.0
        return ForwardOutput(logits=logits)

    def _next(self, position: int) -> int:
        """The token after ``position``: the reply's, once the prompt is known (the first row asked for)."""
        if self._prompt_len < 0:
            self._prompt_len = position + 1
            self._reply = list(self.reply(self.tokens[:self._prompt_len]))
        index = position + 1 - self._prompt_len
        return self._reply[index] if 0 <= index < len(self._reply) else self.eos

    def rollback(self, length: int) -> None:
        self._check_rollback_args(length)
        del self.tokens[length:]
        if length < self._prompt_len:  # back into the prompt: a new request follows (a reused prefix)
            self._prompt_len = -1
