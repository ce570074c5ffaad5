"""A transformers model with a static KV cache whose short passes replay captured CUDA graphs (a GPU draft).

On a GPU, transformers' eager forward is bound by its per-kernel launch and Python overhead, so it costs about the
same whatever the model's size: a draft model as slow per token as its target cannot pay, while the same pass
replayed from a captured ``torch.cuda.CUDAGraph`` costs a fraction of it (figures in ``docs/gpu.md``). A
graph replays fixed kernels on fixed memory, so this backend keeps everything a pass touches at a fixed address,
as gpt-fast does (``pytorch-labs/gpt-fast``, ``generate.py``: a static cache sized once, explicit positions, a
rejected draft rolled back by writing the next pass at the accepted position):

- transformers' ``StaticCache`` of ``capacity`` positions (grown by doubling when a sequence outgrows it: a new
  cache, the cached tokens prefilled again, the graphs captured again);
- the pass's token ids ``[1, n]`` and its first position ``[1]`` in static tensors; the positions, the cache
  positions and the additive attention mask ``[1, 1, n, capacity]`` (a row sees the keys up to its own position,
  so entries past the sequence, left by a rollback, are never read) are computed inside the graph from them;
- transformers releases whose static layers count their own positions get that counter set from the static
  first position, inside the pass;
- one graph per pass width n <= ``max_graph_width``, captured on its first use (eager warm-up passes on a side
  stream first, as capture requires), all in one memory pool. Wider passes (a prompt's prefill) run eagerly
  through the same code.

A rollback only sets the length. The numerics
are not those of :class:`~draftwise.backends.torch_backend.TorchCausalLM` (a mask over the whole static cache,
bf16 by default for a draft), which is why only a draft model runs here by default: the output does not depend on
the draft's numerics (verification accepts a draft token only when it is the target's own choice; rejection
sampling is lossless for any draft distribution). Without CUDA the same passes run eagerly (no capture): the
tests check the cache, mask and rollback logic on the CPU that way.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from draftwise.backends.base import CausalLM, ForwardOutput
from draftwise.backends.torch_backend import TorchCausalLM

__all__ = ["GraphedCausalLM", "MIN_CAPACITY", "MAX_GRAPH_WIDTH", "graph_obstacles"]

logger = logging.getLogger(__name__)

#: the static cache's first size (positions); it doubles when a sequence outgrows it
MIN_CAPACITY = 1024
#: widest pass (tokens) replayed from a graph: a draft's one-token steps and its catch-up after an accepted run
MAX_GRAPH_WIDTH = 8
#: static cache sizes are multiples of this (the memory-efficient attention kernel wants an aligned mask row)
_ALIGN = 64
#: eager passes run on a side stream before a capture (allocator and kernel selection settle)
_WARMUP_PASSES = 2


def graph_obstacles(model: torch.nn.Module) -> list[str]:
    """Why ``model`` cannot run as a :class:`GraphedCausalLM` (empty when it can): a sliding attention window
    (its layers keep a ring buffer this backend does not index) or a layer transformers' static cache cannot
    hold."""
    from transformers import StaticCache

    from draftwise.backends.torch_backend import _active_sliding_window

    reasons = []
    if _active_sliding_window(model.config) is not None:
        reasons.append("a sliding attention window")
    try:
        cache = StaticCache(config=model.config, max_cache_len=_ALIGN)
    except Exception as exc:  # noqa: BLE001 - an architecture transformers' static cache refuses
        return reasons + [f"no static KV cache ({type(exc).__name__}: {exc})"]
    kinds = {type(layer).__name__ for layer in cache.layers}
    if kinds != {"StaticLayer"}:
        reasons.append(f"cache layers of kinds {sorted(kinds)}")
    return reasons


class GraphedCausalLM(TorchCausalLM):
    """A loaded ``transformers`` ``*ForCausalLM`` with a static KV cache; on CUDA its passes of up to
    ``max_graph_width`` tokens replay captured CUDA graphs (see the module docstring).

    Chains only: no tree passes, no cache export, no hidden states. ``forward`` returns float32 CPU logits like
    every backend.

    Args:
        model: the module, on its device and dtype, in eval mode (see :func:`graph_obstacles`).
        name: identity used in messages.
        max_context: context length in tokens (default: ``config.max_position_embeddings``).
        capacity: the static cache's first size in positions (rounded up to a multiple of 64, at most
            ``max_context``); it doubles when needed.
        max_graph_width: widest pass captured as a graph (tokens); 0 keeps every pass eager.

    Raises:
        ValueError: the model has :func:`graph_obstacles`.
    """

    supports_hidden_states = False

    def __init__(self, model: torch.nn.Module, name: str = "model", max_context: int | None = None, *,
                 capacity: int = MIN_CAPACITY, max_graph_width: int = MAX_GRAPH_WIDTH) -> None:
        reasons = graph_obstacles(model)
        if reasons:
            raise ValueError(f"{name} cannot run with a static KV cache: {'; '.join(reasons)}")
        super().__init__(model, name=name, max_context=max_context)
        self.supports_tree = False  # TorchCausalLM sets both per instance from the model
        self.supports_cache_export = False
        self.dtype = next(model.parameters()).dtype
        self.use_graphs = self.device.type == "cuda" and max_graph_width > 0
        self.max_graph_width = max_graph_width
        self._tokens: list[int] = []  # what the cache holds, to refill a grown cache
        self._capacity = 0
        self._graphs: dict[int, _Graph] = {}
        self._pool = None
        self._allocate(_aligned(min(max(capacity, 1), self.max_context)))

    @property
    def capacity(self) -> int:
        """Positions the static cache holds now (tokens)."""
        return self._capacity

    @property
    def num_graphs(self) -> int:
        """Pass widths captured as CUDA graphs so far."""
        return len(self._graphs)

    @torch.inference_mode()
    def forward(self, token_ids: Sequence[int], *, num_logits: int | None = None, return_hidden: bool = False,
                hidden_rows: int | None = None) -> ForwardOutput:
        """As :meth:`CausalLM.forward`, without hidden states.

        Raises:
            ValueError: ``return_hidden`` (this backend keeps no hidden states), an empty or out-of-vocabulary
                ``token_ids``.
            ContextOverflowError: past ``max_context``.
        """
        if return_hidden:
            raise ValueError(f"{self.name}: the static-cache backend returns no hidden states")
        token_ids = [int(t) for t in token_ids]
        self._check_forward_args(token_ids)
        self.cache_owner = None  # the cache changes: it no longer holds what a marker recorded (no export here)
        n = len(token_ids)
        keep = n if num_logits is None else max(1, min(num_logits, n))
        if self._num_cached + n > self._capacity:
            self._grow(self._num_cached + n)
        logits = None
        if self.use_graphs and n <= self.max_graph_width:
            logits = self._replay(token_ids, keep)
        if logits is None:
            logits = self._eager(token_ids, self._num_cached, keep)
        self._num_cached += n
        self._tokens.extend(token_ids)
        out = logits.float()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return ForwardOutput(logits=out.cpu())

    def _replay(self, token_ids: list[int], keep: int) -> torch.Tensor | None:
        """The pass replayed from its width's graph (captured now if new): ``[keep, vocab]`` device logits; None
        when capturing failed (logged; every later pass then runs eagerly, which is correct, only slower)."""
        try:
            return self._graph(len(token_ids)).run(token_ids, self._num_cached)[-keep:]
        except RuntimeError as exc:
            logger.warning("%s: capturing a CUDA graph failed, passes run eagerly from now on: %s", self.name, exc)
            self.use_graphs = False
            self._drop_graphs()
            return None

    def _drop_graphs(self) -> None:
        """Forget the captured graphs and their memory pool: a pool whose graphs are all freed cannot take a new
        capture (PyTorch 2.11 asserts ``use_count > 0`` in its caching allocator), so the next capture opens
        a fresh one."""
        self._graphs.clear()
        self._pool = None

    def forward_tree(self, token_ids, parents, *, return_hidden: bool = False) -> ForwardOutput:
        raise NotImplementedError(f"{self.name}: the static-cache backend runs chains only (tree_width 1)")

    #: a chain's accepted path is a prefix, which is a rollback; anything else is refused (not TorchCausalLM's
    #: gather, which would replace the static tensors)
    compact = CausalLM.compact

    def rollback(self, length: int) -> None:
        self._check_rollback_args(length)  # the next pass writes from the new length (see _pass)
        if length != self._num_cached:
            self.cache_owner = None
        self._num_cached = length
        del self._tokens[length:]

    def _set_layer_lengths(self, first: torch.Tensor) -> None:
        """Releases whose static layers count their own positions (transformers 5.2x: ``cumulative_length``)
        write a pass where that counter says: set it to ``first`` (``[1]``) in place, a device-side copy that a
        graph records (the counter's address is fixed once the layer is initialised)."""
        for layer in self._cache.layers:
            counter = getattr(layer, "cumulative_length", None)
            if isinstance(counter, torch.Tensor):
                counter.copy_(first[0])

    def _allocate(self, capacity: int) -> None:
        from transformers import StaticCache

        self._cache = StaticCache(config=self.model.config, max_cache_len=capacity)
        self._capacity = capacity
        self._drop_graphs()  # they point at the old cache's tensors
        self._key_index = torch.arange(capacity, device=self.device)  # [capacity]

    def _grow(self, needed: int) -> None:
        """A cache of at least ``needed`` positions (doubling, at most ``max_context``), holding what the old one
        held (prefilled again from the kept token ids)."""
        capacity = self._capacity
        while capacity < needed:
            capacity = _aligned(min(2 * capacity, self.max_context))
        logger.info("%s: static KV cache grows from %d to %d positions", self.name, self._capacity, capacity)
        self._allocate(capacity)
        if self._tokens:
            self._eager(self._tokens, 0, 1)

    def _eager(self, token_ids: list[int], start: int, keep: int) -> torch.Tensor:
        """One eager pass of ``token_ids`` written from position ``start``: ``[keep, vocab]`` logits on the
        device."""
        ids = torch.tensor([token_ids], dtype=torch.long, device=self.device)  # [1, n]
        first = torch.tensor([start], dtype=torch.long, device=self.device)  # [1]
        return self._pass(ids, first, keep)

    def _pass(self, ids: torch.Tensor, first: torch.Tensor, keep: int) -> torch.Tensor:
        """The model over ``ids`` (``[1, n]``) at positions ``first + 0..n-1`` (``first`` ``[1]`` on the device),
        each row seeing the cache up to its own position: logits ``[keep, vocab]`` (device, model dtype). Only
        tensor operations on device tensors: capturable as a graph."""
        n = ids.shape[1]
        self._set_layer_lengths(first)
        positions = first + torch.arange(n, device=self.device)  # [n]
        visible = self._key_index[None, :] <= positions[:, None]  # [n, capacity]
        mask = torch.zeros(visible.shape, dtype=self.dtype, device=self.device)
        mask = mask.masked_fill(~visible, torch.finfo(self.dtype).min)[None, None]  # [1, 1, n, capacity]
        with self._attention_kernels():
            out = self.model(input_ids=ids, position_ids=positions[None], cache_position=positions,
                             attention_mask=mask, use_cache=True, logits_to_keep=keep,
                             **{self._cache_arg: self._cache})
        return out.logits[0]

    def _graph(self, width: int) -> _Graph:
        graph = self._graphs.get(width)
        if graph is None:
            if self._pool is None:
                self._pool = torch.cuda.graph_pool_handle()
            graph = _Graph(self, width, self._pool)
            self._graphs[width] = graph
        return graph


class _Graph:
    """One captured pass of ``width`` tokens (all rows' logits) over a :class:`GraphedCausalLM`'s static cache;
    :meth:`run` fills the static inputs, sets the cache length and replays it."""

    def __init__(self, owner: GraphedCausalLM, width: int, pool) -> None:
        self.owner = owner
        self.ids = torch.zeros(1, width, dtype=torch.long, device=owner.device)  # [1, width]
        self.first = torch.zeros(1, dtype=torch.long, device=owner.device)  # [1]
        self.graph: torch.cuda.CUDAGraph | None = None
        self.logits: torch.Tensor | None = None
        self.width = width
        self.pool = pool

    def run(self, token_ids: list[int], start: int) -> torch.Tensor:
        """Logits ``[width, vocab]`` (device memory the next replay overwrites) of ``token_ids`` written from
        position ``start``."""
        self.ids.copy_(torch.tensor([token_ids], dtype=torch.long))
        self.first.fill_(start)
        if self.graph is None:
            self._capture()
        self.graph.replay()
        return self.logits

    def _capture(self) -> None:
        """Warm up on a side stream, then capture. The warm-up passes write this pass's own keys and values where
        the replay writes them too (and initialise a fresh cache's tensors, whose addresses the graph keeps)."""
        owner = self.owner
        side = torch.cuda.Stream(device=owner.device)
        side.wait_stream(torch.cuda.current_stream(owner.device))
        with torch.cuda.stream(side):
            for _ in range(_WARMUP_PASSES):
                owner._pass(self.ids, self.first, self.width)
        torch.cuda.current_stream(owner.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            self.logits = owner._pass(self.ids, self.first, self.width)
        self.graph = graph
        logger.info("%s: captured a CUDA graph for %d-token passes", owner.name, self.width)


def _aligned(positions: int) -> int:
    """``positions`` rounded up to a multiple of :data:`_ALIGN`."""
    return -(-positions // _ALIGN) * _ALIGN
