"""Draft-model proposer: a second, smaller causal LM with the target's tokenizer proposes K tokens
autoregressively (Leviathan et al. 2023, "Fast Inference from Transformers via Speculative Decoding";
Chen et al. 2023, "Accelerating Large Language Model Decoding with Speculative Sampling").

One mechanism, :class:`DraftSlots`, serves every engine: a draft model over a slot backend
(:mod:`draftwise.backends.slots`), drafting for one sequence (any backend as one slot) or for many at once (a
lean multi-slot draft: one catch-up pass, then one pass per draft depth over every drafting sequence). Each
slot is rolled back to the longest common prefix with its sequence's committed context at every call, so
rejected draft tokens are discarded without the engine's help. :class:`DraftModelProposer` is its
:class:`~draftwise.proposers.base.Proposer` face (for one slot kept between requests, or a slot per sequence).

Draft tokens are drawn through the request's :class:`~draftwise.sampling.Sampler`: greedy (argmax), rejection
(a draw from the processed draft distribution, returned as ``draft_probs``) or coupled (the Gumbel-argmax with
the target's noise for the same sequence position, so a well-matched draft picks the target's token with high
probability; the draft is then deterministic given the noise and ``draft_probs`` is None). The request's logits
processors (a grammar, penalties, ``logit_bias``, ``min_tokens``) process each draft row first, with the draft
tokens before it, as they process the target's verification rows: the draft proposes from the distribution the
target verifies with, which raises acceptance and changes nothing in the output.
"""

from __future__ import annotations

import logging
import time
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import torch

from draftwise.backends.base import CausalLM, KVState
from draftwise.backends.lean.model import LeanLlama
from draftwise.backends.slots import (
    LOGITS_ALL,
    LOGITS_LAST,
    LOGITS_NONE,
    Expansion,
    Piece,
    SlotBackend,
    as_slot_backend,
    chunk_counts,
)
from draftwise.methods import FIXED_DRAFT_CONFIDENCE, MIN_DRAFT_WINDOW, is_confidence_threshold
from draftwise.processors.base import LogitsProcessor, Path
from draftwise.speculation.cost_model import PassCostCurve
from draftwise.proposers.base import DraftProposal, DraftSequence, Proposer, StepPricing, common_prefix_length
from draftwise.sampling import Sampler
from draftwise.tree import DraftNode, best_frontier, children_of, select_tree

__all__ = ["DraftSlots", "DraftModelProposer", "DraftRequest", "WINDOW_SINKS", "check_tree_shape", "check_window",
           "fit_vocab", "min_path_scores", "sized_tree", "tree_nodes", "window_view"]

logger = logging.getLogger(__name__)

#: Tokens a windowed draft keeps from the context's start, the "attention sinks" (StreamingLLM, Xiao et al. 2023):
#: a model whose first tokens are cut away attends badly to the rest.
WINDOW_SINKS = 4


@dataclass(frozen=True)
class _DraftState:
    """A draft model's kept state: the tokens its slot holds and the exported keys/values (None when the
    draft's backend cannot export its cache); ``cut``: where a windowed draft's recent part starts in the
    sequence (0: the whole context; see :func:`window_view`)."""

    tokens: tuple[int, ...]
    kv: KVState | None
    cut: int = 0

    @property
    def nbytes(self) -> int:
        return self.kv.nbytes if self.kv is not None else 0


@dataclass(frozen=True)
class DraftRequest:
    """One sequence's drafting request: ``key`` (its identity), its draft ``slot``, committed ``context``
    (``[n]`` prompt + output), ``sampler`` and at most ``k`` tokens deep.

    ``width`` > 1 asks for a draft tree (on a backend with ``supports_expansion``): each depth expands the
    ``width`` best frontier nodes with their ``width`` best children, and the ``budget`` best nodes (None:
    ``k * width``) form the tree.

    ``offset``: sequence positions the context skips (0, or for a windowed draft's view of it, see
    :func:`window_view`): a token at view index i >= :data:`WINDOW_SINKS` has sequence position ``i + offset``,
    which the sampler draws at (coupled noise, seeds).

    ``processors``: the sequence's logits processors (None: none), applied to each draft row with the draft tokens
    before it; their state is the committed context's and is not moved."""

    key: int
    slot: int
    context: Sequence[int]
    sampler: Sampler
    k: int
    width: int = 1
    budget: int | None = None
    offset: int = 0
    processors: LogitsProcessor | None = None


def window_view(context: Sequence[int], cut: int) -> tuple[list[int], int]:
    """A windowed draft's view of ``context`` (``[n]`` token ids): the first :data:`WINDOW_SINKS` tokens and those
    from ``cut`` on (the whole context when ``cut`` <= WINDOW_SINKS); returns ``(view, offset)``, ``offset`` the
    number of tokens skipped (``cut - WINDOW_SINKS``, or 0)."""
    if cut <= WINDOW_SINKS:
        return list(context), 0
    return list(context[:WINDOW_SINKS]) + list(context[cut:]), cut - WINDOW_SINKS


def check_window(window: int | None) -> None:
    """Raise ValueError unless ``window`` is None (the whole context) or >= :data:`MIN_DRAFT_WINDOW` tokens."""
    if window is not None and window < MIN_DRAFT_WINDOW:
        raise ValueError(f"draft_window must be >= {MIN_DRAFT_WINDOW} tokens (or null for the whole context), "
                         f"got {window}")


def min_path_scores(confidence_threshold: float | str | Sequence[float]) -> tuple[float, ...]:
    """The smallest log path probability a chain may grow past, per depth (``scores[j - 1]`` after j proposed
    tokens; deeper ones take the last): ``()`` when nothing stops a chain (a threshold of 0), ``+inf`` where a
    threshold of 1 or more stops it.

    Raises:
        ValueError: not a number in [0, 1) nor a non-empty sequence of numbers >= 0; ``"auto"`` (the builder
            resolves it with the calibrated costs, :func:`draftwise.speculation.cost_model.draft_stop_thresholds`).
    """
    if confidence_threshold == "auto":
        raise ValueError("confidence_threshold 'auto' (draft_confidence_threshold) needs the calibrated costs: build "
                         "the engine with draftwise.builder.build_engine, or pass draft_stop_thresholds(costs, k)")
    if isinstance(confidence_threshold, (int, float)) and not isinstance(confidence_threshold, bool):
        thresholds = (float(confidence_threshold),)
        valid = is_confidence_threshold(confidence_threshold)
    else:
        try:
            thresholds = () if isinstance(confidence_threshold, str) else tuple(confidence_threshold)
        except TypeError:
            thresholds = ()
        valid = bool(thresholds) and all(not isinstance(t, bool) and isinstance(t, (int, float)) and t >= 0
                                         for t in thresholds)
    if not valid:
        raise ValueError("confidence_threshold (draft_confidence_threshold) must be a number in [0, 1) or a "
                         f"non-empty sequence of per-depth numbers >= 0, got {confidence_threshold!r}")
    if all(t <= 0 for t in thresholds):
        return ()
    return tuple(math.log(t) if 0 < t < 1 else (float("-inf") if t <= 0 else math.inf) for t in thresholds)


@dataclass
class _Growth:
    """One request's draft while it grows, depth by depth: a chain (``width`` 1: tokens drawn with the
    request's sampler, their ``probs`` kept for rejection sampling) or a tree (:class:`DraftNode` list).

    Attributes:
        request: the request; ``room``: its depth limit; ``base``: its committed context length (the slot
            holds that much before the draft); ``fed``: draft tokens written past ``base``.
        nodes: the draft's nodes in creation order (a chain's too); ``probs``: a chain's ``[vocab]`` rows.
        expanded: the nodes whose logits the next pass returns (``[-1]``: the root, after the catch-up).
        is_tree: a tree (``width`` > 1 on a backend that grows trees), else a chain.
    """

    request: DraftRequest
    room: int
    base: int
    nodes: list[DraftNode]
    probs: list[torch.Tensor]
    expanded: list[int]
    is_tree: bool
    fed: int = 0


class DraftSlots:
    """A draft model drafting chains for one or many sequences (Leviathan et al. 2023 per sequence).

    A call: one pass over the tokens each drafting sequence's slot lacks (at least its last committed token;
    the prompt after joining; longer catch-ups are split into passes of at most ``max_pass_rows`` rows), whose
    last row per sequence gives the logits of its first draft token; then one pass per further draft depth
    over one row per sequence still drafting. Tokens are drawn with each sequence's sampler (greedy, coupled
    with the target's noise, or rejection with ``draft_probs``).

    Args:
        draft: the draft as a slot backend, a lean model (its slots) or any CausalLM (one slot).
        target_vocab_size: the target's logits width (draft logits are cut or padded with -inf to it, so a draft
            whose embedding is padded differently still yields ``[k, target_vocab]`` distributions; ids the
            target cannot produce are never proposed).
        max_pass_rows: rows per catch-up pass.
        verify_seconds: ``rows -> seconds`` of the target's verification pass (its cost curve); with it, a draft
            tree keeps only as many of its best nodes as pay (:func:`sized_tree`), at most the request's budget.
        window: None: the draft reads the whole context. An int W (tokens, >= :data:`MIN_DRAFT_WINDOW`): the draft
            reads the first :data:`WINDOW_SINKS` tokens and the most recent ones, at least W and at most 2W of them
            (StreamingLLM's sinks and window, Xiao et al. 2023): a context longer than ``2W + sinks`` is cut to its
            last W, and the view grows with the sequence until it outgrows 2W and is cut again (one catch-up of
            W tokens). A long prompt then costs the draft a prefill of W tokens. Lossless: the draft's context
            changes what it proposes, never what the target accepts.
        confidence_threshold: a chain stops growing once the draft's probability of its whole path (the product
            of its tokens' probabilities under the processed distribution, :meth:`Sampler.logprob`) falls below
            a threshold; the token that crossed it is kept. A number in [0, 1) is the threshold at every depth (0
            drafts every chain ``k`` deep); a sequence gives one per depth, ``thresholds[j - 1]`` after j
            proposed tokens (deeper ones take the last; values >= 1 stop there), as
            :func:`draftwise.speculation.cost_model.draft_stop_thresholds` derives them from the measured costs. Each further
            draft token costs a draft pass and a verify row and pays only if the path so far is right, which its
            probability estimates (the draft's confidence, as EAGLE-2 reads it for trees and Hugging Face's
            ``assistant_confidence_threshold`` per token). Trees are sized by :func:`sized_tree` instead.
            Lossless: it changes how many tokens are proposed, never which are accepted.

    Raises:
        ValueError: ``window`` below :data:`MIN_DRAFT_WINDOW`; ``confidence_threshold`` not a number in [0, 1) nor
            a non-empty sequence of numbers >= 0 (``"auto"`` is resolved by the builder, which has the costs).

    Attributes:
        pass_costs: the measured seconds of its passes per row count.
        supports_trees: requests with ``width`` > 1 get draft trees (the backend grows a tree one depth per
            pass: the lean runtime).
    """

    def __init__(self, draft: SlotBackend | CausalLM | LeanLlama, target_vocab_size: int,
                 max_pass_rows: int = 512, verify_seconds: Callable[[int], float] | None = None,
                 window: int | None = None,
                 confidence_threshold: float | Sequence[float] = FIXED_DRAFT_CONFIDENCE) -> None:
        check_window(window)
        self._min_path_scores = min_path_scores(confidence_threshold)
        self.backend = as_slot_backend(draft)
        self.window = window
        self.verify_seconds = verify_seconds
        self.target_vocab_size = target_vocab_size
        self.max_pass_rows = max_pass_rows
        self.vocab_size = self.backend.vocab_size
        self.pass_costs = PassCostCurve()
        self._cached: dict[int, list[int]] = {}  # key -> tokens in its slot, in order
        self._grown: dict[int, _Growth] = {}  # key -> its last draft tree (its fed nodes' entries)
        self._cuts: dict[int, int] = {}  # key -> where its windowed view's recent part starts (window_view)
        self.supports_trees = bool(getattr(self.backend, "supports_expansion", False))

    def cached(self, key: int) -> list[int]:
        """The tokens ``key``'s slot holds."""
        return self._cached.setdefault(key, [])

    def lacking(self, key: int, context: Sequence[int]) -> int:
        """Tokens of ``context`` (as the draft reads it) that ``key``'s slot lacks: the rows its next draft's
        first pass feeds (at least 1)."""
        view, _ = window_view(context, self._cuts.get(key, 0))
        return max(1, len(view) - common_prefix_length(self.cached(key), view))

    def reset(self, key: int, slot: int) -> None:
        """Empty ``key``'s slot (and forget its window)."""
        self._empty(key, slot)
        self._cuts.pop(key, None)

    def _empty(self, key: int, slot: int) -> None:
        self._cached[key] = []
        self._grown.pop(key, None)
        self.backend.set_length(slot, 0)

    def forget(self, key: int) -> None:
        """``key`` left (its slot is someone else's now)."""
        self._cached.pop(key, None)
        self._grown.pop(key, None)
        self._cuts.pop(key, None)

    def export(self, key: int, slot: int, context: Sequence[int] | None = None) -> _DraftState | None:
        """The slot's kept state: its tokens up to the common prefix with ``context``'s view (None: all it
        holds), with their keys/values when the backend can export; None when it holds nothing."""
        cached, cut = self.cached(key), self._cuts.get(key, 0)
        length = len(cached) if context is None else common_prefix_length(cached, window_view(context, cut)[0])
        if length <= 0:
            return None
        kv = self.backend.export_slot(slot, length) if self.backend.supports_export else None
        return _DraftState(tuple(cached[:length]), kv, cut)

    def reusable(self, state: _DraftState, prompt: Sequence[int], length: int) -> int:
        """How many of ``state``'s tokens hold for a sequence whose first ``length`` tokens match the ``prompt``
        the state was kept for (the state's tokens are a windowed view when its ``cut`` > 0)."""
        view, offset = window_view(prompt, state.cut)
        shared = length - offset if length > WINDOW_SINKS else length
        return max(0, min(shared, len(state.tokens), common_prefix_length(state.tokens, view)))

    def adopt(self, key: int, slot: int, state: _DraftState | None, length: int | None = None) -> None:
        """Load a kept state (its first ``length`` tokens; None: all; its window with it); None empties the slot.

        A state without keys/values comes from a draft backend that cannot export its cache (llama.cpp): the
        slot then keeps only the part of its live contents that equals the state's tokens, and the next call
        prefills the rest of the context.
        """
        if state is None:
            self.reset(key, slot)
            return
        if state.cut > 0:
            self._cuts[key] = state.cut
        else:
            self._cuts.pop(key, None)
        if state.kv is not None:
            n = len(state.tokens) if length is None else min(length, len(state.tokens))
            self.backend.import_slot(slot, state.kv, n)
            self._cached[key] = list(state.tokens[:n])
        else:
            self._forget_if_changed(key, slot)
            cached = self.cached(key)
            common = common_prefix_length(cached, state.tokens)
            self.backend.set_length(slot, common)
            del cached[common:]

    def _forget_if_changed(self, key: int, slot: int) -> None:
        """Empty the slot when it no longer holds as many tokens as were fed to it here (another user of the
        draft backend, e.g. a calibration, changed it): the next call then prefills the whole context."""
        if self.backend.length(slot) != len(self.cached(key)):
            logger.debug("draft slot %d holds %d tokens, not the %d fed here: starting it afresh", slot,
                         self.backend.length(slot), len(self.cached(key)))
            self._empty(key, slot)

    def _windowed(self, request: DraftRequest) -> DraftRequest:
        """``request`` with its context as the draft reads it (:func:`window_view` at the key's cut; a new cut
        when the view would outgrow the window)."""
        if self.window is None:
            return request
        length, cut = len(request.context), self._cuts.get(request.key, 0)
        if cut >= length - 1:  # a shorter or new context: the old cut says nothing about it
            cut = 0
        skipped = cut - WINDOW_SINKS if cut > WINDOW_SINKS else 0
        if length - skipped > 2 * self.window + WINDOW_SINKS:  # the view's length, without building it twice
            cut = length - self.window
        if cut > WINDOW_SINKS:
            self._cuts[request.key] = cut
        else:
            self._cuts.pop(request.key, None)
        view, offset = window_view(request.context, cut)
        return replace(request, context=view, offset=offset) if offset else request

    def draft(self, requests: Sequence[DraftRequest]) -> list[DraftProposal]:
        """A chain (or, with ``width`` > 1, a tree) at most ``k`` tokens deep for each request (shallower near the
        draft's context end): one catch-up pass, then one pass per depth over every growing draft's expanded
        nodes (a chain's last token, a tree's ``width`` best frontier nodes)."""
        growths = []
        for request in map(self._windowed, requests):
            room = min(request.k, self.backend.max_context - len(request.context))
            tree = request.width > 1 and self.supports_trees
            if tree:  # a tree writes a node per expanded frontier node
                room = min(room, (self.backend.max_context - len(request.context)) // request.width)
            growths.append(_Growth(request, room, len(request.context), [], [], [-1], tree))
        active = [g for g in growths if g.room > 0]
        t0 = time.perf_counter()
        logits = self._catch_up([g.request for g in active])  # [len(active), V]
        depth = 1
        while active:
            row = 0
            for growth in active:
                rows = logits[row:row + len(growth.expanded)]
                row += len(growth.expanded)
                self._add_children(growth, rows, depth)
            active = [g for g in active if depth < g.room and self._confident(g) and self._choose_expanded(g, depth)]
            if not active:
                break
            logits = self._run_depth(active, depth)
            depth += 1
        draft_s = time.perf_counter() - t0
        return [self._proposal(g, draft_s) for g in growths]

    def _add_children(self, growth: _Growth, rows: torch.Tensor, depth: int) -> None:
        """The children (at ``depth``) of each expanded node from its logits row (``rows [m, V]``)."""
        request = growth.request
        position = len(request.context) + request.offset + depth - 1  # the sequence position the children take
        if request.processors is not None:
            rows = processed_rows(request.processors, rows, [draft_path(growth.nodes, p) for p in growth.expanded])
        for parent, logits in zip(growth.expanded, rows):
            base_score = 0.0 if parent < 0 else growth.nodes[parent].score
            if not growth.is_tree:
                token, p = request.sampler.choose(logits, position)
                score = base_score + request.sampler.logprob(logits, token, p) if self._min_path_scores else 0.0
                growth.nodes.append(DraftNode(token, parent, depth, score))
                if p is not None:
                    growth.probs.append(p)
                continue
            tokens, logprobs = request.sampler.candidates(logits, position, request.width)
            growth.nodes.extend(DraftNode(t, parent, depth, base_score + lp) for t, lp in zip(tokens, logprobs))

    def _confident(self, growth: _Growth) -> bool:
        """Whether a chain may grow past its newest token: its path probability is still at or above the
        confidence threshold of its depth (trees always may: :func:`sized_tree` sizes them)."""
        if growth.is_tree or not self._min_path_scores:
            return True
        scores = self._min_path_scores
        return growth.nodes[-1].score >= scores[min(len(growth.nodes), len(scores)) - 1]

    @staticmethod
    def _choose_expanded(growth: _Growth, depth: int) -> bool:
        """Set the nodes the next pass feeds (a chain's last node; the best ``width`` of a tree's newest depth);
        False when there are none."""
        frontier = [i for i, node in enumerate(growth.nodes) if node.depth == depth]
        if not growth.is_tree:
            growth.expanded = frontier[-1:]
        else:
            growth.expanded = best_frontier(growth.nodes, frontier, growth.request.width)
        return bool(growth.expanded)

    def _run_depth(self, active: list[_Growth], depth: int) -> torch.Tensor:
        """One draft pass feeding every active draft's expanded nodes (depth ``depth``); returns their logits
        ``[sum of expanded, V]`` in order."""
        pieces = []
        for growth in active:
            request, start = growth.request, growth.base + growth.fed
            tokens = [growth.nodes[i].token for i in growth.expanded]
            expansion = None
            if growth.is_tree:
                ancestors = []
                for i in growth.expanded:
                    chain, node = [], growth.nodes[i].parent
                    while node >= 0:
                        chain.append(growth.nodes[node].entry)
                        node = growth.nodes[node].parent
                    ancestors.append(tuple(reversed(chain)))
                expansion = Expansion(growth.base, tuple(growth.base + depth - 1 for _ in tokens), tuple(ancestors))
            for r, i in enumerate(growth.expanded):
                growth.nodes[i].entry = start + r
            growth.fed += len(tokens)
            pieces.append((request, tokens, start, expansion))
        return self._run(pieces, logits=LOGITS_ALL)

    def _proposal(self, growth: _Growth, draft_s: float) -> DraftProposal:
        """The grown draft as a proposal; a tree's best ``budget`` nodes, or fewer when the target's cost curve
        is known (:func:`sized_tree`, with the drafting time ``draft_s`` seconds); its slot is cut back to the
        committed context, the fed nodes' entries kept for :meth:`_keep_accepted_path`."""
        request = growth.request
        if not growth.is_tree:
            tokens = tuple(node.token for node in growth.nodes)
            return DraftProposal(tokens, torch.stack(growth.probs) if growth.probs else None)
        if growth.fed:
            self.backend.set_length(request.slot, growth.base)
            self._grown[request.key] = growth
        budget = request.budget if request.budget is not None else request.k * request.width
        if self.verify_seconds is not None:
            budget = sized_tree(growth.nodes, budget, draft_s, self.verify_seconds)
        tokens, parents = select_tree(growth.nodes, budget)
        return DraftProposal(tokens, parents=parents)

    def _keep_accepted_path(self, request: DraftRequest) -> None:
        """After a tree draft, keep the entries of the fed nodes on the path the target accepted (a prefix of the
        context past the tree's base): packed after the committed context, so the catch-up feeds only the rest."""
        growth = self._grown.pop(request.key, None)
        cached = self.cached(request.key)
        if growth is None or len(cached) != growth.base or self.backend.length(request.slot) != growth.base:
            return
        children, node, keep = children_of([n.parent for n in growth.nodes]), -1, []
        for token in request.context[growth.base:len(request.context) - 1]:
            node = next((c for c in children[node] if growth.nodes[c].token == token), -1)
            if node < 0 or growth.nodes[node].entry < 0:
                break
            keep.append(growth.nodes[node].entry - growth.base)
        if keep:
            self.backend.compact(request.slot, growth.base, keep)
            cached.extend(request.context[growth.base:growth.base + len(keep)])

    def _catch_up(self, requests: list[DraftRequest]) -> torch.Tensor:
        """Feed every request's slot what it lacks of its context; returns the logits after each context
        (``[len(requests), target_vocab]``)."""
        pending = []
        for request in requests:
            self._forget_if_changed(request.key, request.slot)
            self._keep_accepted_path(request)
            cached = self.cached(request.key)
            common = min(common_prefix_length(cached, request.context), len(request.context) - 1)
            del cached[common:]
            pending.append((request, list(request.context[common:]), common))
        if not pending:
            return torch.empty(0, self.target_vocab_size)
        # passes of at most max_pass_rows rows; a request's logits come from its last row
        out: dict[int, torch.Tensor] = {}
        while pending:
            counts = chunk_counts([len(toks) for _, toks, _ in pending], self.max_pass_rows, self.backend.max_pieces)
            batch = [(r, toks[:c], start, c == len(toks)) for (r, toks, start), c in zip(pending, counts) if c > 0]
            logits = self._run([(r, t, start, None) for r, t, start, _ in batch], want=[done for *_, done in batch])
            row = 0
            for request, _, _, done in batch:
                if done:
                    out[request.key] = logits[row]
                    row += 1
            pending = [(r, toks[c:], start + c) for (r, toks, start), c in zip(pending, counts) if c < len(toks)]
        return torch.stack([out[r.key] for r in requests])

    def _run(self, pieces: list[tuple[DraftRequest, list[int], int, Expansion | None]], want: list[bool] | None = None,
             logits: str = LOGITS_LAST) -> torch.Tensor:
        """One draft pass over pieces ``(request, tokens, start, expansion)`` (a chain when ``expansion`` is None);
        returns, cut or padded to the target's width, each piece's ``logits`` rows (``want[i]`` False: none for
        piece i). A chain's fed tokens join its slot's cached tokens; a tree's nodes do not."""
        batch = []
        for i, (request, toks, start, expansion) in enumerate(pieces):
            readable = [t if t < self.vocab_size else 0 for t in toks]  # an id only the target's vocab has
            batch.append(Piece(request.slot, start, readable, logits=logits if want is None or want[i] else LOGITS_NONE,
                               expansion=expansion))
        t0 = time.perf_counter()
        out = self.backend.forward(batch).logits
        self.pass_costs.observe(sum(len(p.token_ids) for p in batch), max(time.perf_counter() - t0, 1e-9))
        for request, toks, start, expansion in pieces:
            cached = self.cached(request.key)
            if expansion is None and len(cached) == start:
                cached.extend(toks)
        return fit_vocab(out, self.target_vocab_size)


class DraftModelProposer(Proposer):
    """The draft-model proposer (Leviathan et al. 2023 per sequence): :class:`DraftSlots` drafting for every
    speculating sequence of a step at once, one catch-up pass and then one pass per depth.

    Two ways to hold the sequences' draft state (``slot_per_sequence``):

    - False (the default; an engine of one slot, the library's :class:`~draftwise.engine.SpeculativeEngine`):
      the sequence's slot of the draft (any :class:`CausalLM` as one slot; a lean draft through its slot cache,
      so it can grow trees) keeps its contents between requests, so a follow-up request that shares a prefix
      reuses them without a prefix cache (reconciled by common prefix at the next draft); a kept state is the
      whole slot's. A ``tree_width`` the draft cannot grow falls back to chains (logged).
    - True (an engine of many slots): one draft slot per engine slot (a sequence uses the same slot index in
      both), emptied when a sequence joins and freed when it leaves; a kept state is the committed context's.
      The engine calibrates and prices the draft's passes (:attr:`drafting_model`). A ``tree_width`` the draft
      cannot grow is refused.

    Args:
        draft: the draft: a lean model (its slots), a slot backend, or any CausalLM (one slot).
        target_vocab_size: the target's logits width (draft logits are cut or padded to it; see
            :class:`DraftSlots`).
        tree_width: 1 drafts chains; w > 1 draft trees (EAGLE-2's expansion, see :class:`DraftRequest`) on a
            lean draft.
        tree_budget: nodes per tree at most (None: ``k * tree_width``).
        verify_seconds: the target's ``rows -> seconds`` pass cost; trees are then sized by it (see
            :func:`sized_tree`).
        window: the draft reads at most this many tokens of a long context (None: all; see :class:`DraftSlots`).
        confidence_threshold: chains stop below this path probability, one number or one per depth (0: always
            ``k`` deep; see :class:`DraftSlots`).
        max_pass_rows: rows per catch-up pass.
        slot_per_sequence: see above.

    Raises:
        ValueError: ``tree_width`` or ``tree_budget`` < 1, ``tree_width`` > 1 on a draft that cannot grow trees
            with ``slot_per_sequence``, ``window`` below :data:`MIN_DRAFT_WINDOW`, ``confidence_threshold``
            invalid (:func:`min_path_scores`).

    Attributes:
        slots: the :class:`DraftSlots` it drafts with; ``pass_costs``: its measured seconds per pass by row count.
    """

    name = "draft_model"
    drafts_first = False  # a model: K is planned first and only that many tokens are drafted

    def __init__(self, draft: SlotBackend | CausalLM | LeanLlama, target_vocab_size: int, tree_width: int = 1,
                 tree_budget: int | None = None, verify_seconds: Callable[[int], float] | None = None,
                 window: int | None = None,
                 confidence_threshold: float | Sequence[float] = FIXED_DRAFT_CONFIDENCE, *,
                 max_pass_rows: int = 512, slot_per_sequence: bool = False) -> None:
        check_tree_shape(tree_width, tree_budget)
        self.draft = draft
        self.target_vocab_size = target_vocab_size
        self.slot_per_sequence = slot_per_sequence
        self.slots = DraftSlots(draft, target_vocab_size, max_pass_rows, verify_seconds, window, confidence_threshold)
        if tree_width > 1 and not self.slots.supports_trees:
            if slot_per_sequence:
                raise ValueError(f"{self.slots.backend.name}: tree_width {tree_width} needs a draft on the lean "
                                 "runtime")
            logger.warning("draft model %s: tree_width %d needs the lean runtime; drafting chains",
                           getattr(draft, "name", self.slots.backend.name), tree_width)
            tree_width = 1
        self.tree_width = tree_width
        self.tree_budget = tree_budget
        self.model: LeanLlama | None = getattr(self.slots.backend, "model", None)  # the lean draft, when lean
        self.pass_costs = self.slots.pass_costs

    @property
    def drafting_model(self) -> DraftModelProposer | None:
        """Itself with a slot per sequence (the engine calibrates and prices its passes), else None."""
        return self if self.slot_per_sequence else None

    @property
    def num_slots(self) -> int:
        return self.slots.backend.num_slots

    def _key(self, sequence: DraftSequence) -> int:
        """Whose draft state a sequence's is: its own, or its slot's (kept between requests)."""
        return sequence.seq_id if self.slot_per_sequence else sequence.slot

    def lacking(self, sequence: DraftSequence) -> int:
        """Rows the sequence's next draft feeds in its first pass: what its draft slot lacks of its context."""
        return self.slots.lacking(self._key(sequence), sequence.context)

    def tree_nodes(self, k: int) -> int:
        """Draft nodes a draft ``k`` tokens deep has at most (:func:`tree_nodes`)."""
        return tree_nodes(k, self.tree_width, self.tree_budget)

    def open(self, sequence: DraftSequence) -> None:
        if self.slot_per_sequence:
            self.slots.reset(sequence.seq_id, sequence.slot)

    def close(self, sequence: DraftSequence) -> None:
        if not self.slot_per_sequence:
            return  # the slot keeps its contents for the next request
        self.slots.forget(sequence.seq_id)
        if 0 <= sequence.slot < self.num_slots:
            self.slots.backend.set_length(sequence.slot, 0)

    def export_state(self, sequence: DraftSequence) -> _DraftState | None:
        """The draft's cached tokens (with a slot per sequence: those of the committed context, not the drafts
        past them) and, when its backend can export, their KV cache (shared, not copied)."""
        if self.slot_per_sequence:
            return self.slots.export(sequence.seq_id, sequence.slot, sequence.context)
        state = self.slots.export(sequence.slot, sequence.slot)
        return state if state is not None else _DraftState(tokens=(), kv=None)

    def import_state(self, sequence: DraftSequence, state: _DraftState | None, length: int) -> None:
        """Load a kept draft state (see :meth:`DraftSlots.adopt`); None: start empty (with a slot per sequence,
        :meth:`open` emptied it already)."""
        if not self.slot_per_sequence:
            self.slots.adopt(sequence.slot, sequence.slot, state if state is None or state.tokens else None)
            return
        if state is None:
            return
        length = self.slots.reusable(state, sequence.prompt, length)
        if length > 0:
            self.slots.adopt(sequence.seq_id, sequence.slot, state, length)

    def propose(self, requests: Sequence[tuple[DraftSequence, int]],
                pricing: StepPricing | None = None) -> list[DraftProposal]:
        return self.slots.draft([DraftRequest(self._key(s), s.slot, list(s.context), s.sampler, k, self.tree_width,
                                              self.tree_budget, processors=s.processors) for s, k in requests])


def sized_tree(nodes: Sequence[DraftNode], budget: int, draft_s: float, verify_seconds: Callable[[int], float]) -> int:
    """How many of a draft tree's best nodes to verify: the n <= ``budget`` with the most expected committed
    tokens per second, ``(1 + sum of the n best nodes' path probabilities) / (draft_s + verify_seconds(n + 1))``.

    A node's path probability (the draft's, ``exp(score)``) estimates the chance the target accepts the path
    to it, so the sum over the kept nodes estimates the accepted tokens (EAGLE-2's reading of the draft's
    confidence; Sequoia sizes its trees against the measured verification cost the same way). The drafting time
    is spent either way; only the verification grows with n.

    Args:
        nodes: the grown tree, in creation order.
        budget: nodes at most (>= 1).
        draft_s: seconds the draft took (this step's).
        verify_seconds: ``rows -> seconds`` of a target pass (root + nodes).

    Returns:
        n in 1..budget.
    """
    scores = sorted((node.score for node in nodes), reverse=True)[:budget]
    best_n, best_rate, expected = 1, -1.0, 1.0
    for n, score in enumerate(scores, start=1):
        expected += math.exp(score)
        rate = expected / (draft_s + verify_seconds(n + 1))
        if rate > best_rate:
            best_n, best_rate = n, rate
    return best_n


def check_tree_shape(tree_width: int, tree_budget: int | None) -> None:
    """Raise ``ValueError`` unless ``tree_width >= 1`` and ``tree_budget`` is None or >= 1."""
    if tree_width < 1 or (tree_budget is not None and tree_budget < 1):
        raise ValueError(f"tree_width and tree_budget must be >= 1, got {tree_width} and {tree_budget}")


def tree_nodes(k: int, tree_width: int, tree_budget: int | None) -> int:
    """Draft nodes a draft ``k`` tokens deep has at most: k for a chain (``tree_width`` 1), the tree budget
    (default ``k * tree_width``) for a tree."""
    if tree_width == 1:
        return k
    return tree_budget if tree_budget is not None else k * tree_width


def draft_path(nodes: Sequence[DraftNode], node: int) -> Path:
    """The draft tokens from the committed context down to ``node`` (itself included; ``()`` for the root, -1)."""
    path = []
    while node >= 0:
        path.append(nodes[node].token)
        node = nodes[node].parent
    return tuple(reversed(path))


def processed_rows(processors: LogitsProcessor, rows: torch.Tensor, paths: Sequence[Path]) -> torch.Tensor:
    """A copy of draft logits ``rows [m, V]`` processed by ``processors``, row i after the draft tokens
    ``paths[i]`` (:meth:`~draftwise.processors.base.LogitsProcessor.apply`)."""
    with torch.inference_mode():  # a pass's logits are inference tensors
        rows = rows.clone()
        processors.apply(rows, paths)
    return rows


def fit_vocab(logits: torch.Tensor, width: int) -> torch.Tensor:
    """Cut or pad draft logits ``[..., draft_vocab]`` to ``[..., width]`` (the target's logits width; padding
    gets -inf, so ids the target cannot produce are never proposed)."""
    current = logits.shape[-1]
    if current == width:
        return logits
    if current > width:
        return logits[..., :width]
    pad = torch.full((*logits.shape[:-1], width - current), float("-inf"), dtype=logits.dtype)
    return torch.cat([logits, pad], dim=-1)
