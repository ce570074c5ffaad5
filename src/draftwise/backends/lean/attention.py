"""Batch-invariant attention over a slot's KV cache in fixed-size key blocks, vectorised over rows.

A row's output must not depend on which other rows share the pass (bit for bit), or greedy verification of k
tokens would not reproduce one-token decoding. Three sources of variation, and how each is removed:

1. GEMM kernels are chosen by shape. On MKL (measured on an AMD Zen3, AVX2) ``A[:M] @ B`` gives other bits for
   M = 5, 6, 7, 9, 10, 11 than for large M, and identical bits for every M that is a multiple of 4; on other CPUs
   the rule differs. So the query rows ``[kv_heads, M, head_dim]`` (M = rows x query heads per KV head) are
   zero-padded to a multiple of :func:`row_multiple`, found by a measured self-test at first use.
2. Reductions over keys depend on the key count. Scores are computed over the slot's keys padded to whole
   blocks of ``block`` keys; keys a row may not see are masked to -inf (so exp gives exact zeros); softmax sums
   and the probabilities x values products are formed per block (a fixed reduction length), and the per-block
   partial results are added in block order (:func:`sum_blocks`, a left fold, so trailing all-zero blocks of
   shorter rows add exact zeros). A row's reduction order therefore depends on its own visible length only.
3. The max over keys is exact whatever the order.

This is the fixed-split-size idea of "Defeating Nondeterminism in LLM Inference" (He et al., Thinking Machines
2025) applied to a CPU decode / verify / prefill kernel. Grouped-query attention never materialises repeated
heads: the ``g = heads / kv_heads`` query heads sharing a KV head are stacked as rows of one GEMM.
"""

from __future__ import annotations

import functools
import logging

import torch

__all__ = ["block_attention", "tree_block_attention", "native_attention", "native_attention_available", "row_multiple",
           "rows_invariant", "sum_blocks"]

logger = logging.getLogger(__name__)

_CANDIDATE_MULTIPLES = (1, 2, 4, 8, 16)


def block_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, visible: torch.Tensor, *,
                    scale: float, block: int, multiple: int) -> torch.Tensor:
    """Attention of n query rows of one sequence over its cached keys.

    Args:
        query: ``[n, heads, head_dim]`` float32 (rotary already applied).
        keys, values: ``[kv_heads, L, head_dim]`` the slot's cache, ``L`` a multiple of ``block`` (entries a
            row may not see hold finite values).
        visible: ``[n, L]`` bool, True where row r may attend (every row sees at least one key).
        scale: score multiplier (``head_dim ** -0.5``).
        block: keys per block (the fixed reduction length).
        multiple: query rows per KV head are zero-padded to a multiple of this (see :func:`row_multiple`).

    Returns:
        ``[n, heads, head_dim]`` float32.
    """
    n, heads, head_dim = query.shape
    kv_heads, length, _ = keys.shape
    groups = heads // kv_heads
    blocks = length // block
    rows = n * groups
    padded = -(-rows // multiple) * multiple
    # [n, kv, g, d] -> [kv, n * g, d]: the g query heads of a KV head are rows of one GEMM (no repeated KV).
    q = query.view(n, kv_heads, groups, head_dim).permute(1, 0, 2, 3).reshape(kv_heads, rows, head_dim)
    if padded != rows:
        q = torch.cat([q, q.new_zeros(kv_heads, padded - rows, head_dim)], dim=1)
    scores = torch.bmm(q, keys.transpose(1, 2))  # [kv, P, L]
    scores.mul_(scale)
    mask = visible.repeat_interleave(groups, dim=0)  # [n * g, L], row order n-major as q
    if padded != rows:
        mask = torch.cat([mask, mask.new_ones(padded - rows, length)], dim=0)
    scores.masked_fill_(~mask, float("-inf"))
    scores.sub_(scores.amax(dim=-1, keepdim=True))
    probs = scores.exp_()  # [kv, P, L], exact zeros where masked
    blocked = probs.view(kv_heads, padded, blocks, block)
    denominator = sum_blocks(blocked.sum(dim=-1), dim=-1).unsqueeze(-1)  # [kv, P, 1]
    # per-block P_b @ V_b: [kv * blocks, P, block] @ [kv * blocks, block, d] -> [kv, blocks, P, d]
    p_blocks = blocked.permute(0, 2, 1, 3).reshape(kv_heads * blocks, padded, block)
    v_blocks = values.reshape(kv_heads * blocks, block, head_dim)
    partial = torch.bmm(p_blocks, v_blocks).view(kv_heads, blocks, padded, head_dim)
    out = sum_blocks(partial, dim=1)  # [kv, P, d]
    out = out.div_(denominator)[:, :rows]  # [kv, n * g, d]
    return out.view(kv_heads, n, groups, head_dim).permute(1, 0, 2, 3).reshape(n, heads, head_dim)


def native_attention_available() -> str | None:
    """None when the native attention (``draftwise_native::attention`` in the extension beside the GGUF kernels,
    ``kernels/attention.cpp``) builds and loads here, else why not."""
    from draftwise.backends.kernels.q4k import q4k_available

    return q4k_available()


def native_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, prefix: torch.Tensor,
                     tail: torch.Tensor, tail_len: torch.Tensor, *, scale: float) -> torch.Tensor:
    """Attention of n query rows over one slot's cache in the native extension: row r sees the entries
    ``[0, prefix[r])`` in place, then ``tail[r, :tail_len[r]]`` in that order (a draft tree's tail). Each
    (row, KV head) is computed alone over its keys in logical order (``kernels/attention.cpp``), so a row's
    bits depend on neither the other rows nor where its keys sit: a tree node gets its chain's bits, and a
    verified chain one-token decoding's, by construction. Its bits differ from :func:`block_attention`'s; a
    model uses one of the two for every pass.

    Args:
        query: ``[n, heads, head_dim]`` float32 (rotary applied).
        keys, values: ``[kv_heads, capacity, head_dim]`` float32, the slot's cache of one layer.
        prefix, tail_len: ``[n]`` int64; tail: ``[n, T]`` int64 cache entries (T may be 0).
        scale: score multiplier.

    Returns:
        ``[n, heads, head_dim]`` float32.

    Raises:
        RuntimeError: shapes that do not match, an entry outside the cache, a row that sees no key.
    """
    return torch.ops.draftwise_native.attention(query, keys, values, prefix, tail, tail_len, scale)


def sum_blocks(partials: torch.Tensor, dim: int) -> torch.Tensor:
    """Sum per-block partial results along ``dim`` strictly in block order (a left fold of elementwise float
    adds), removing ``dim``: the one reduction across key blocks, so trailing all-zero blocks add exact zeros
    and a row's result depends on its own blocks only."""
    blocks = partials.unbind(dim)
    total = blocks[0].clone()
    for block in blocks[1:]:
        total.add_(block)
    return total


def tree_block_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, shared_visible: torch.Tensor,
                         tail_index: torch.Tensor, tail_visible: torch.Tensor, *, scale: float, block: int,
                         multiple: int) -> torch.Tensor:
    """Attention of draft-tree rows, bit for bit what :func:`block_attention` gives the same row in a chain.

    A tree node's key sits at another cache index than it would in a chain (siblings come between), and the
    block sums depend on where a key falls. So each row's keys are split at a block edge S: the shared blocks
    ``[0, S)`` hold the same keys for every row and are read in place; the rest (committed keys from S, then
    the row's ancestors and itself) is gathered per row in logical order into its own blocks, exactly the
    layout a chain would have. The max, the per-block partial sums and their sequential combination then
    match the chain's.

    Args:
        query: ``[n, heads, head_dim]``.
        keys, values: ``[kv_heads, L, head_dim]`` the slot's cache (tail indexes point into it).
        shared_visible: ``[n, S]`` bool (S a multiple of ``block``, may be 0).
        tail_index: ``[n, T]`` int64 cache indexes of each row's keys after S, in logical order (T a multiple
            of ``block``; padding entries may point anywhere valid).
        tail_visible: ``[n, T]`` bool, False on padding.
        scale, block, multiple: as :func:`block_attention`.

    Returns:
        ``[n, heads, head_dim]`` float32.
    """
    n, heads, head_dim = query.shape
    kv_heads = keys.shape[0]
    groups = heads // kv_heads
    shared, tail = shared_visible.shape[1], tail_index.shape[1]
    # shared part: as block_attention, rows of all tree nodes in one GEMM per KV head
    rows = n * groups
    padded = -(-rows // multiple) * multiple
    q = query.view(n, kv_heads, groups, head_dim).permute(1, 0, 2, 3).reshape(kv_heads, rows, head_dim)
    if padded != rows:
        q = torch.cat([q, q.new_zeros(kv_heads, padded - rows, head_dim)], dim=1)
    # tail part: each row against its own gathered keys; the g query heads of a KV head are the GEMM rows
    g_padded = -(-groups // multiple) * multiple
    qt = query.view(n, kv_heads, groups, head_dim)
    if g_padded != groups:
        qt = torch.cat([qt, qt.new_zeros(n, kv_heads, g_padded - groups, head_dim)], dim=2)
    kt = keys[:, tail_index].permute(1, 0, 2, 3)  # [n, kv, T, d]
    vt = values[:, tail_index].permute(1, 0, 2, 3)
    tail_scores = torch.bmm(qt.reshape(n * kv_heads, g_padded, head_dim),
                            kt.reshape(n * kv_heads, tail, head_dim).transpose(1, 2)).view(n, kv_heads, g_padded, tail)
    tail_scores.mul_(scale)
    tail_scores.masked_fill_(~tail_visible[:, None, None, :], float("-inf"))
    top = tail_scores[:, :, :groups].amax(dim=-1).permute(1, 0, 2)  # [kv, n, g]
    if shared:
        scores = torch.bmm(q, keys[:, :shared].transpose(1, 2))  # [kv, P, S]
        scores.mul_(scale)
        mask = shared_visible.repeat_interleave(groups, dim=0)
        if padded != rows:
            mask = torch.cat([mask, mask.new_ones(padded - rows, shared)], dim=0)
        scores.masked_fill_(~mask, float("-inf"))
        top = torch.maximum(top, scores[:, :rows].amax(dim=-1).view(kv_heads, n, groups))
    # probabilities and per-block partials, in the canonical layout [kv, n, g, blocks(, d)]
    tail_top = top.permute(1, 0, 2)  # [n, kv, g]
    if g_padded != groups:
        tail_top = torch.cat([tail_top, tail_top.new_zeros(n, kv_heads, g_padded - groups)], dim=2)
    tail_probs = tail_scores.sub_(tail_top[..., None]).exp_()  # [n, kv, gp, T]
    tail_blocks = tail // block
    tb = tail_probs.view(n, kv_heads, g_padded, tail_blocks, block)
    tail_den = tb.sum(dim=-1)[:, :, :groups].permute(1, 0, 2, 3)  # [kv, n, g, tb]
    p_blocks = tb.permute(0, 1, 3, 2, 4).reshape(n * kv_heads * tail_blocks, g_padded, block)
    v_blocks = vt.reshape(n * kv_heads * tail_blocks, block, head_dim)
    tail_num = torch.bmm(p_blocks, v_blocks).view(n, kv_heads, tail_blocks, g_padded, head_dim)
    tail_num = tail_num[:, :, :, :groups].permute(1, 0, 3, 2, 4)  # [kv, n, g, tb, d]
    if shared:
        shared_top = top.reshape(kv_heads, rows)
        if padded != rows:
            shared_top = torch.cat([shared_top, shared_top.new_zeros(kv_heads, padded - rows)], dim=1)
        probs = scores.sub_(shared_top[..., None]).exp_()  # [kv, P, S]
        shared_blocks = shared // block
        blocked = probs.view(kv_heads, padded, shared_blocks, block)
        shared_den = blocked.sum(dim=-1)[:, :rows].view(kv_heads, n, groups, shared_blocks)
        sp = blocked.permute(0, 2, 1, 3).reshape(kv_heads * shared_blocks, padded, block)
        sv = values[:, :shared].reshape(kv_heads * shared_blocks, block, head_dim)
        shared_num = torch.bmm(sp, sv).view(kv_heads, shared_blocks, padded, head_dim)[:, :, :rows]
        shared_num = shared_num.view(kv_heads, shared_blocks, n, groups, head_dim).permute(0, 2, 3, 1, 4)
        tail_den = torch.cat([shared_den, tail_den], dim=-1)
        tail_num = torch.cat([shared_num, tail_num], dim=-2)
    denominator = sum_blocks(tail_den, dim=-1).unsqueeze(-1)  # [kv, n, g, 1]
    numerator = sum_blocks(tail_num, dim=-2)  # [kv, n, g, d]
    out = numerator / denominator  # [kv, n, g, d]
    return out.permute(1, 0, 2, 3).reshape(n, heads, head_dim)


def rows_invariant(heads: int, kv_heads: int, head_dim: int, block: int, multiple: int, *, lengths=(1, 37, 200),
                   counts=(1, 2, 3, 5, 8, 13, 17, 33), seed: int = 0) -> bool:
    """Self-test: does :func:`block_attention` give every row the same bits whatever rows share the pass?

    For each context length, rows ``0..c-1`` of a chain ending at that length are computed together (c in
    ``counts``) and compared with each row computed alone.
    """
    generator = torch.Generator().manual_seed(seed)
    scale = head_dim ** -0.5
    for length in lengths:
        total = max(counts) + length
        capacity = -(-total // block) * block
        keys = torch.randn(kv_heads, capacity, head_dim, generator=generator)
        values = torch.randn(kv_heads, capacity, head_dim, generator=generator)
        query = torch.randn(max(counts), heads, head_dim, generator=generator)
        key_index = torch.arange(capacity)

        def run(first: int, count: int) -> torch.Tensor:
            ends = torch.arange(length + first, length + first + count) + 1
            visible = key_index[None, :] < ends[:, None]
            used = -(-int(ends.max()) // block) * block
            return block_attention(query[first:first + count], keys[:, :used], values[:, :used], visible[:, :used],
                                   scale=scale, block=block, multiple=multiple)

        alone = [run(i, 1) for i in range(max(counts))]
        for count in counts:
            together = run(0, count)
            if not all(torch.equal(together[i], alone[i][0]) for i in range(count)):
                return False
    return True


@functools.lru_cache(maxsize=None)
def row_multiple(heads: int, kv_heads: int, head_dim: int, block: int, threads: int) -> int:
    """The smallest query-row padding multiple that makes :func:`block_attention` row-invariant on this
    machine, found by :func:`rows_invariant` (cached per shape and thread count for the process; a few
    hundred ms). ``threads`` is part of the key only (the caller's ``torch.get_num_threads()``).

    Raises:
        RuntimeError: no candidate multiple is invariant (the CPU's GEMM kernels defeat padding).
    """
    for multiple in _CANDIDATE_MULTIPLES:
        if rows_invariant(heads, kv_heads, head_dim, block, multiple):
            logger.info("block attention: query rows padded to a multiple of %d (heads %d/%d, head dim %d, %d threads)",
                        multiple, heads, kv_heads, head_dim, threads)
            return multiple
    raise RuntimeError(f"no row padding in {_CANDIDATE_MULTIPLES} makes attention batch-invariant on this CPU "
                       f"(heads {heads}/{kv_heads}, head dim {head_dim})")
