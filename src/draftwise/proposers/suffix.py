"""Suffix decoding proposer: draft what most often followed the context's suffix, in this request and in
earlier outputs of the same scope.

SuffixDecoding (Oliaro et al., "SuffixDecoding: Extreme Speculative Decoding for Emerging AI Applications",
2024/2025, https://arxiv.org/abs/2411.04975; vLLM's ``method: "suffix"``, which wraps Arctic Inference's
``SuffixDecodingCache``). No second model. Two indexes of the same kind (:class:`SuffixIndex`):

- the request's own index over its prompt and committed output, kept across requests and reconciled by
  longest common prefix (an agent loop's next turn extends the previous conversation, so only the new tokens
  are indexed);
- a cross-request index per scope (:class:`SuffixCache`) over the outputs of earlier requests of the same
  scope (API key or user), bounded in requests and tokens, oldest evicted first (FIFO). A seeded sampling
  request does not read it, so that its text depends only on its own seed and context
  (:func:`uses_earlier_requests`).

At each step the proposer matches the context's suffix in both indexes. Every match length p (a node on the
suffix-link chain of the longest match) yields a candidate (:func:`speculate`): starting at the matched node,
draft tokens are added best-first by the empirical probability of their whole path (the product of
``count(child) / continuations(parent)`` frequency ratios) while that probability stays >=
``min_token_prob``, at most ``floor(max_spec_factor * p)`` tokens deep (and at most K), and with
``tree_width`` > 1 up to ``tree_width`` children per node (a draft tree). A candidate's score is the sum of
its nodes' path probabilities, its expected number of accepted tokens; the best-scoring candidate of either
index wins (the paper's rule). So the draft length follows the match's confidence; K is only a cap.

Index: a suffix trie of bounded depth D (``max_tree_depth``): every substring of at most D tokens of every
indexed sequence is a path from the root, each node counting its occurrences (``count``) and the occurrences
that continue (``cont``, the sum of its children's counts), with a suffix link to the node of its path minus
the first token. Appending a token touches the nodes of the suffixes ending at the previous token (the
suffix-link chain of that token's deepest node) and their children: at most D + 1 nodes, whatever the
context length; removing the last token touches at most D. Matching the context's suffix walks the last
D - 1 tokens of the context along child and suffix links (amortized O(D)). Memory: at most D nodes per
indexed token (far fewer on repetitive text, where paths are shared), each a small Python object.
Indexing happens once per request and only for the tokens past the common prefix with the previous request;
its cost (per depth D), its memory and a drafting step's cost are in docs/agent_bench.md.

Drafts are deterministic (``draft_probs=None``), so sampling verification treats them as one-hot draft
distributions and stays lossless; trees are verified by the engine's tree verification.
"""

from __future__ import annotations

import heapq
import logging
import math
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from draftwise.config import SamplingParams
from draftwise.proposers.base import DraftProposal, SequenceProposer, common_prefix_length
from draftwise.tree import chain_parents
from draftwise.sampling import Sampler

if TYPE_CHECKING:
    from draftwise.config import SpeculativeConfig

__all__ = ["SuffixIndex", "SuffixNode", "SuffixCache", "SuffixDraft", "SuffixProposer", "KeptSuffixIndex",
           "SUFFIX_NODE_BYTES", "speculate", "best_draft", "uses_earlier_requests"]

logger = logging.getLogger(__name__)


class SuffixNode:
    """One trie node: the path from the root to it is a token string that occurs in the indexed sequences.

    Attributes:
        token: the last token of the path (-1 for the root).
        depth: the path length in tokens (0 for the root).
        count: occurrences of the path in the indexed sequences.
        cont: occurrences followed by another indexed token (the sum of the children's counts).
        parent: the node of the path without its last token (None for the root).
        link: the suffix link, the node of the path without its first token (None for the root).
        children: next token -> child node, or None while there are none.
    """

    __slots__ = ("token", "depth", "count", "cont", "parent", "link", "children")

    def __init__(self, token: int, depth: int, parent: SuffixNode | None) -> None:
        self.token = token
        self.depth = depth
        self.count = 0
        self.cont = 0
        self.parent = parent
        self.link: SuffixNode | None = None
        self.children: dict[int, SuffixNode] | None = None


class SuffixIndex:
    """Bounded-depth suffix trie over several growing token sequences (see the module docstring).

    Args:
        max_depth: D, the longest substring indexed (>= 2: a match of at least one token plus one next token).

    Raises:
        ValueError: ``max_depth`` < 2.

    Attributes:
        update_work: nodes touched by appends and removals so far (the complexity tests read it).
        match_work: child and suffix-link steps taken by :meth:`match` so far.
    """

    def __init__(self, max_depth: int) -> None:
        if max_depth < 2:
            raise ValueError(f"max_depth must be >= 2, got {max_depth}")
        self.max_depth = max_depth
        self.root = SuffixNode(-1, 0, None)
        self._tokens: dict[int, list[int]] = {}  # sequence id -> its tokens
        self._ends: dict[int, list[SuffixNode]] = {}  # sequence id -> deepest node ending at each position
        self._next_id = 0
        self.update_work = 0
        self.match_work = 0
        self.num_nodes = 0  # nodes below the root (what the index's memory grows with)

    # ------------------------------------------------------------------ sequences
    def add_sequence(self) -> int:
        """A new, empty sequence; returns its id."""
        seq = self._next_id
        self._next_id += 1
        self._tokens[seq], self._ends[seq] = [], []
        return seq

    def sequence(self, seq: int) -> list[int]:
        """The tokens of sequence ``seq`` (the index's own list: do not modify it)."""
        return self._tokens[seq]

    @property
    def num_sequences(self) -> int:
        return len(self._tokens)

    @property
    def num_tokens(self) -> int:
        """Tokens indexed over all sequences (the root's occurrence count)."""
        return self.root.count

    def extend(self, seq: int, token_ids: Sequence[int]) -> None:
        """Append tokens to sequence ``seq`` (each costs at most D + 1 node updates)."""
        for token in token_ids:
            self.append(seq, int(token))

    def append(self, seq: int, token: int) -> None:
        """Append one token: count it after every suffix (of at most D - 1 tokens) that ends at the previous
        token, creating the missing nodes and their suffix links."""
        ends = self._ends[seq]
        node = ends[-1] if ends else self.root
        if node.depth == self.max_depth:
            node = node.link
        chain = []
        while node is not None:  # deepest to the root
            chain.append(node)
            node = node.link
        shorter = None  # the child just made for the next-shorter suffix: the suffix link of the next one
        for node in reversed(chain):  # root first, so each new child's suffix link already exists
            children = node.children
            if children is None:
                children = node.children = {}
            child = children.get(token)
            if child is None:
                child = children[token] = SuffixNode(token, node.depth + 1, node)
                self.num_nodes += 1
                child.link = self.root if shorter is None else shorter
            child.count += 1
            node.cont += 1
            shorter = child
        self.root.count += 1
        self.update_work += len(chain)
        ends.append(shorter)
        self._tokens[seq].append(token)

    def pop(self, seq: int) -> None:
        """Remove the last token of sequence ``seq`` (at most D node updates); nodes left without occurrences
        are deleted.

        Raises:
            IndexError: the sequence is empty.
        """
        node = self._ends[seq].pop()
        token = self._tokens[seq].pop()
        self.root.count -= 1
        while node is not None and node.depth > 0:  # every suffix that ends at the removed token
            parent = node.parent
            node.count -= 1
            parent.cont -= 1
            if node.count == 0:
                del parent.children[token]
                self.num_nodes -= 1
                if not parent.children:
                    parent.children = None
            self.update_work += 1
            node = node.link

    def truncate(self, seq: int, length: int) -> None:
        """Keep the first ``length`` tokens of sequence ``seq``. Costs O(D) per removed token, or, when the
        index holds only this sequence and fewer tokens are kept than removed, O(D) per kept token (rebuilt)."""
        tokens = self._tokens[seq]
        length = max(0, length)
        if length >= len(tokens):
            return
        if self.num_sequences == 1 and length < len(tokens) - length:
            kept = tokens[:length]
            self.root = SuffixNode(-1, 0, None)
            self.num_nodes = 0
            self._tokens[seq], self._ends[seq] = [], []
            self.extend(seq, kept)
            return
        while len(tokens) > length:
            self.pop(seq)

    def remove_sequence(self, seq: int) -> None:
        """Forget sequence ``seq`` (O(D) per token)."""
        self.truncate(seq, 0)
        del self._tokens[seq], self._ends[seq]

    # ------------------------------------------------------------------ lookups
    def match(self, window: Sequence[int]) -> SuffixNode:
        """The node of the longest suffix of ``window`` that occurs in the index (the root if none).

        Matching statistics along suffix links (as in Aho-Corasick): amortized O(len(window)) steps. Pass
        at most the last D - 1 tokens of a context to leave room for a next token.
        """
        node = self.root
        steps = 0
        for token in window:
            while True:
                children = node.children
                child = children.get(token) if children is not None else None
                steps += 1
                if child is not None:
                    node = child
                    break
                if node.link is None:  # the root: the token does not occur at all
                    break
                node = node.link
        self.match_work += steps
        return node

    def find(self, path: Sequence[int]) -> SuffixNode | None:
        """The node of exactly ``path`` (None if it does not occur or is longer than D)."""
        node = self.root
        for token in path:
            child = node.children.get(token) if node.children is not None else None
            if child is None:
                return None
            node = child
        return node


# ---------------------------------------------------------------------------------------------- drafting
@dataclass(frozen=True)
class SuffixDraft:
    """A scored draft from one matched suffix.

    Attributes:
        token_ids: ``[n]`` draft tokens, in topological order (parents first).
        parents: ``[n]`` parent indices (-1 = the last committed token), as in :mod:`draftwise.tree`.
        probs: ``[n]`` empirical probability of each node's whole path given the match (non-increasing).
        match_length: p, tokens of the context's suffix matched (0 for an empty draft).
    """

    token_ids: tuple[int, ...] = ()
    parents: tuple[int, ...] = ()
    probs: tuple[float, ...] = ()
    match_length: int = 0

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def score(self) -> float:
        """Expected accepted draft tokens under the empirical frequencies: the sum of the path probabilities."""
        return float(sum(self.probs))

    @property
    def is_chain(self) -> bool:
        return self.parents == chain_parents(len(self.parents))

    def proposal(self) -> DraftProposal:
        """The draft as a :class:`DraftProposal` (a chain when it is one, else a tree)."""
        if self.is_chain:
            return DraftProposal(token_ids=self.token_ids)
        return DraftProposal(token_ids=self.token_ids, parents=self.parents)


EMPTY_DRAFT = SuffixDraft()


def speculate(node: SuffixNode, max_tokens: int, min_prob: float, width: int = 1) -> SuffixDraft:
    """Best-first draft below ``node`` (the matched suffix).

    Nodes are added in order of decreasing path probability (``count(child) / cont(parent)`` multiplied along
    the path) while it is >= ``min_prob``; each added node offers its ``width`` most frequent children (ties:
    smaller token id). At most ``max_tokens`` deep and ``max_tokens * width`` nodes; ``width`` 1 gives the
    most frequent chain.
    """
    tokens: list[int] = []
    parents: list[int] = []
    probs: list[float] = []
    if max_tokens < 1 or node.cont <= 0:
        return EMPTY_DRAFT
    heap: list[tuple[float, int, int, int, SuffixNode]] = []  # (-prob, order, depth, parent index, node)
    order = 0

    def offer(parent_node: SuffixNode, parent_prob: float, parent_index: int, depth: int) -> None:
        nonlocal order
        children = parent_node.children
        if children is None or parent_node.cont <= 0:
            return
        if width == 1:
            best = [min(children.values(), key=_frequency_order)]
        else:
            best = heapq.nsmallest(width, children.values(), key=_frequency_order)
        for child in best:
            prob = parent_prob * child.count / parent_node.cont
            if prob >= min_prob:
                heapq.heappush(heap, (-prob, order, depth, parent_index, child))
                order += 1

    offer(node, 1.0, -1, 1)
    budget = max_tokens * width
    while heap and len(tokens) < budget:
        neg_prob, _, depth, parent_index, child = heapq.heappop(heap)
        tokens.append(child.token)
        parents.append(parent_index)
        probs.append(-neg_prob)
        if depth < max_tokens:
            offer(child, -neg_prob, len(tokens) - 1, depth + 1)
    return SuffixDraft(tuple(tokens), tuple(parents), tuple(probs), node.depth)


def _frequency_order(node: SuffixNode) -> tuple[int, int]:
    return -node.count, node.token


def best_draft(index: SuffixIndex, window: Sequence[int], k: int, max_spec_factor: float, min_prob: float,
               width: int = 1) -> SuffixDraft:
    """The best-scoring :func:`speculate` draft over every match length of ``window``'s suffix in ``index``.

    A match of p tokens may draft at most ``min(k, floor(max_spec_factor * p))`` tokens (and the trie's depth
    leaves at most D - p). Candidates whose bound cannot beat the best score so far are skipped; ties keep the
    longer match.
    """
    best = EMPTY_DRAFT
    node = index.match(window)
    while node is not None and node.depth > 0:
        limit = min(k, math.floor(max_spec_factor * node.depth + 1e-9), index.max_depth - node.depth)
        if node.cont > 0 and limit > best.score:
            draft = speculate(node, limit, min_prob, width)
            if draft.score > best.score:
                best = draft
        node = node.link
    return best


# ---------------------------------------------------------------------------------------------- cross-request
class SuffixCache:
    """The outputs of earlier requests, one :class:`SuffixIndex` per scope, bounded in requests and tokens over
    all scopes together (oldest output evicted first).

    Args:
        max_depth: D of the indexes.
        max_requests: outputs kept (0 keeps none).
        max_tokens: tokens kept; a longer output keeps its last ``max_tokens`` tokens (0 keeps none).

    Raises:
        ValueError: negative bounds or ``max_depth`` < 2.
    """

    def __init__(self, max_depth: int, max_requests: int, max_tokens: int) -> None:
        if max_requests < 0 or max_tokens < 0 or max_depth < 2:
            raise ValueError("need max_depth >= 2 and non-negative max_requests, max_tokens")
        self.max_depth = max_depth
        self.max_requests = max_requests
        self.max_tokens = max_tokens
        self._indexes: dict[str, SuffixIndex] = {}
        self._entries: OrderedDict[tuple[str, int], int] = OrderedDict()  # (scope, sequence id) -> tokens
        self.num_tokens = 0

    @property
    def num_requests(self) -> int:
        return len(self._entries)

    @property
    def scopes(self) -> tuple[str, ...]:
        return tuple(self._indexes)

    def index(self, scope: str) -> SuffixIndex | None:
        """The index of ``scope``'s kept outputs (None when there are none)."""
        return self._indexes.get(scope)

    def add(self, scope: str, output_ids: Sequence[int]) -> None:
        """Keep one finished output of ``scope`` (O(D) per token), then evict the oldest outputs (of any
        scope) until both bounds hold."""
        if self.max_requests == 0 or self.max_tokens == 0 or not output_ids:
            return
        tokens = list(output_ids)[-self.max_tokens :]
        index = self._indexes.get(scope)
        if index is None:
            index = self._indexes[scope] = SuffixIndex(self.max_depth)
        seq = index.add_sequence()
        index.extend(seq, tokens)
        self._entries[(scope, seq)] = len(tokens)
        self.num_tokens += len(tokens)
        while len(self._entries) > self.max_requests or self.num_tokens > self.max_tokens:
            self._evict_oldest()

    def _evict_oldest(self) -> None:
        (scope, seq), length = self._entries.popitem(last=False)
        index = self._indexes[scope]
        index.remove_sequence(seq)
        self.num_tokens -= length
        if index.num_sequences == 0:
            del self._indexes[scope]


# ---------------------------------------------------------------------------------------------- proposer
#: Memory of one index node with its share of the children dicts (bytes; tracemalloc over 2,000 novel tokens at
#: D = 24: 7.3 KB a token, 24 nodes a token)
SUFFIX_NODE_BYTES = 300


@dataclass
class _Request:
    scope: str
    prompt: list[int]


@dataclass
class KeptSuffixIndex:
    """A finished request's own suffix index, kept in the engine's prefix cache beside its KV state
    (:meth:`SuffixProposer.export_state`): the next request that shares the prefix (an agent's next turn) adopts
    it and indexes only its new tokens, where a fresh index costs D node updates per prompt token. One owner at a
    time: adopting takes it (``index`` becomes None), so another request matching the same entry indexes its
    prompt itself. Its memory (:attr:`nbytes`) counts against the cache's budget with the KV state it travels
    with, until a request adopts it.

    Attributes:
        index: the :class:`SuffixIndex`, or None once adopted.
        seq: the request's sequence id in it.
    """

    index: SuffixIndex | None
    seq: int

    @property
    def nbytes(self) -> int:
        """Estimated memory of the index (bytes): :data:`SUFFIX_NODE_BYTES` a node; 0 once adopted."""
        return 0 if self.index is None else self.index.num_nodes * SUFFIX_NODE_BYTES


class SuffixProposer(SequenceProposer):
    """Suffix decoding over the current request and earlier outputs of its scope (see the module docstring).

    Args:
        max_tree_depth: D, the longest substring indexed (>= 2).
        max_spec_factor: a match of p tokens drafts at most ``floor(factor * p)`` tokens (> 0).
        min_token_prob: draft only while the path's empirical probability stays >= this (in [0, 1]).
        max_cached_requests, max_cached_tokens: bounds of the cross-request index (:class:`SuffixCache`).
        tree_width: children per draft-tree node (1: a chain). Use > 1 only when the target backend runs
            trees (``supports_tree``).

    Raises:
        ValueError: on out-of-range arguments.

    Attributes:
        last_draft: the :class:`SuffixDraft` of the latest call (diagnostics).
    """

    name = "suffix"
    drafts_first = True  # a lookup: the engine sees the tokens offered before it plans K

    def __init__(self, max_tree_depth: int = 24, max_spec_factor: float = 1.0, min_token_prob: float = 0.1,
                 max_cached_requests: int = 1000, max_cached_tokens: int = 50_000, tree_width: int = 1) -> None:
        if not max_spec_factor > 0 or not (0.0 <= min_token_prob <= 1.0) or tree_width < 1:
            raise ValueError("need max_spec_factor > 0, 0 <= min_token_prob <= 1 and tree_width >= 1")
        self.local = SuffixIndex(max_tree_depth)
        self._seq = self.local.add_sequence()
        self.cache = SuffixCache(max_tree_depth, max_cached_requests, max_cached_tokens)
        self.max_spec_factor = max_spec_factor
        self.min_token_prob = min_token_prob
        self.tree_width = tree_width
        self._request: _Request | None = None  # None: no start() (e.g. a calibration run): nothing is archived
        self.last_draft = EMPTY_DRAFT

    @property
    def max_tree_depth(self) -> int:
        return self.local.max_depth

    def start(self, prompt_ids: Sequence[int], *, scope: str = "") -> None:
        """Archive the previous request's output under its scope and begin a request; its prompt is indexed at
        the first draft (only the part past its common prefix with what the request index holds, which a kept
        index adopted by :meth:`import_state` may already hold)."""
        self._archive()
        self._request = _Request(scope, [int(t) for t in prompt_ids])  # indexed at the first draft (:meth:`_sync`)

    def export_state(self) -> KeptSuffixIndex:
        """Hand the request index over (for the prefix cache to give a later request sharing its prefix) at the
        request's end: its output is archived first, and this proposer goes on with an empty index, so an index
        has one owner (a proposer shared by every request of a one-slot engine adopts it back on a prefix hit)."""
        self._archive()
        kept = KeptSuffixIndex(self.local, self._seq)
        self.local = SuffixIndex(self.local.max_depth)
        self._seq = self.local.add_sequence()
        return kept

    def import_state(self, state: KeptSuffixIndex | None) -> None:
        """Adopt a kept request index (taking it from ``state``); None, or one already adopted elsewhere: keep
        this proposer's own index (synced by common prefix at the first draft)."""
        if isinstance(state, KeptSuffixIndex) and state.index is not None:
            if state.index.max_depth == self.local.max_depth:
                self.local, self._seq = state.index, state.seq
            state.index = None

    def finish(self) -> None:
        """Archive the request's output under its scope now (the next :meth:`start` would do it otherwise)."""
        self._archive()

    def propose(
        self, context_ids: Sequence[int], k: int, params: SamplingParams, sampler: Sampler
    ) -> DraftProposal:
        return self.best_draft(context_ids, k, use_earlier=uses_earlier_requests(params)).proposal()

    def best_draft(self, context_ids: Sequence[int], k: int, *, use_earlier: bool = True) -> SuffixDraft:
        """The best draft of at most ``k`` tokens deep after ``context_ids`` from the request's index and, with
        ``use_earlier``, its scope's earlier outputs (an empty draft when nothing matches)."""
        context = context_ids if isinstance(context_ids, list) else list(context_ids)
        if k <= 0 or not context:
            self.last_draft = EMPTY_DRAFT
            return EMPTY_DRAFT
        self._sync(context)
        window = context[-(self.max_tree_depth - 1) :]
        options = (k, self.max_spec_factor, self.min_token_prob, self.tree_width)
        best = best_draft(self.local, window, *options)
        earlier = self.cache.index(self._request.scope) if self._request is not None and use_earlier else None
        if earlier is not None:
            other = best_draft(earlier, window, *options)
            if other.score > best.score:
                best = other
        self.last_draft = best
        return best

    def _sync(self, context: list[int]) -> None:
        """Make the request index hold exactly ``context``: append what is new, roll back past the longest
        common prefix when it differs. The prefix check is one C-level list comparison (the same order of cost
        as the engine building the context list), never index work per context token."""
        indexed = self.local.sequence(self._seq)
        if len(indexed) <= len(context) and context[: len(indexed)] == indexed:
            common = len(indexed)
        else:
            common = common_prefix_length(indexed, context)
            logger.debug("suffix index rolled back from %d to %d tokens", len(indexed), common)
            self.local.truncate(self._seq, common)
        self.local.extend(self._seq, context[common:])

    def _archive(self) -> None:
        """Keep the finished request's output (what the request index holds past its prompt) for later
        requests of its scope. The last step's tokens never reach the proposer and are not kept."""
        request, self._request = self._request, None
        if request is None:
            return
        tokens = self.local.sequence(self._seq)
        prompt_len = len(request.prompt)
        if len(tokens) > prompt_len and tokens[:prompt_len] == request.prompt:
            self.cache.add(request.scope, tokens[prompt_len:])


def uses_earlier_requests(params: SamplingParams) -> bool:
    """Whether a request may draft from earlier requests' outputs: not a seeded sampling request, whose text
    must depend on its own seed and context only (the drafts decide how its random numbers are consumed);
    greedy output never depends on the drafts, and unseeded sampling promises no reproducibility."""
    return params.greedy or params.seed is None


def suffix_proposer_from_config(config: SpeculativeConfig, *, supports_tree: bool) -> SuffixProposer:
    """A :class:`SuffixProposer` with the config's ``suffix_decoding_*`` fields; a tree width > 1 falls back to
    chains (with a log line) when the target cannot verify trees."""
    width = config.suffix_decoding_tree_width
    if width > 1 and not supports_tree:
        logger.warning("suffix_decoding_tree_width %d needs a target backend that verifies draft trees; "
                       "drafting chains", width)
        width = 1
    return SuffixProposer(
        max_tree_depth=config.suffix_decoding_max_tree_depth,
        max_spec_factor=config.suffix_decoding_max_spec_factor,
        min_token_prob=config.suffix_decoding_min_token_prob,
        max_cached_requests=config.suffix_decoding_max_cached_requests,
        max_cached_tokens=config.suffix_decoding_max_cached_tokens,
        tree_width=width,
    )
