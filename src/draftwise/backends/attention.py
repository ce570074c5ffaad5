"""Batch-invariant attention (and activations, rotary embeddings) for the CPU path: one position at a time.

Speculative verification runs the target over k new tokens in one pass and compares its argmax with what
one-token decoding would have produced. That comparison is only exact if a position's logits do not depend on
how many tokens share the pass. ``transformers``' eager and SDPA attention compute all n new query rows with
one batched matmul and one masked softmax over the full key length; the BLAS library picks kernels by matrix
shape, and a masked row sums its softmax over trailing zeros in a different order than the same row computed
alone, so the results differ in the last bits.

:func:`rowwise_attention` instead loops over the n new rows. Row i (absolute position ``p = L - n + i`` of a
sequence whose keys and values, cache included, have length L) attends to keys ``[start, p]`` with exactly the
tensor shapes one-token decoding at position p uses (one query row against ``p + 1`` keys), so its output
is computed by the same kernels on the same numbers: bit for bit the one-token result. The causal (and
sliding-window) structure comes from the shapes; no mask tensor is built.

Tree passes (several draft branches in one pass) pass a 4D mask; each row's visible keys are gathered into
the same contiguous layout one-token decoding along that branch uses, so tree verification stays exact.

Limits: one unpadded sequence per batch row (the draftwise backends never pad); a padded 2D attention mask
raises ``NotImplementedError``. The loop costs a few small kernel launches per row and layer, negligible for
the k <= ~17 rows of a verify pass and a few percent of a long prefill.

Register with :func:`register_rowwise_attention` (idempotent) and select with
``model.set_attn_implementation(ROWWISE_ATTENTION)``; :func:`use_rowwise_attention` does both.

Elementwise transcendental functions have the same problem in a milder form (SIMD body vs scalar tail, thread
chunks), so :func:`make_batch_invariant` also wraps MLP activations and rotary embeddings to run per position.
Linear layers are the remaining piece; :mod:`draftwise.backends.quantization` makes those batch-invariant.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

__all__ = ["ROWWISE_ATTENTION", "RowwiseActivation", "RowwiseRotary", "make_batch_invariant",
           "register_rowwise_attention", "rowwise_attention", "use_rowwise_attention"]

logger = logging.getLogger(__name__)

ROWWISE_ATTENTION = "draftwise_rowwise"


def rowwise_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Causal attention of the last n positions, one query row at a time (``AttentionInterface`` signature).

    Args:
        module: the attention module (unused; part of the interface).
        query: ``[b, heads, n, head_dim]``, the n new positions (the last n of the sequence).
        key, value: ``[b, kv_heads, L, head_dim]``, every position so far (cache plus the n new ones);
            ``heads`` must be a multiple of ``kv_heads`` (grouped-query attention).
        attention_mask: None from the registered mask function (causality then comes from shapes), or a
            custom 4D ``[1, 1, n, L]`` tree mask (bool, or additive with 0 = visible) from a tree pass
            (:meth:`draftwise.backends.torch_backend.TorchCausalLM.forward_tree`): each row then attends to
            its visible keys, gathered in order (batch 1 only).
        scaling: multiplier of the scores (usually ``head_dim ** -0.5``).
        dropout: must be 0 (inference only).
        sliding_window: attend to at most this many most recent keys (None: all).

    Returns:
        ``([b, n, heads, head_dim]`` attention output in ``query``'s dtype, None) as transformers expects.

    Raises:
        ValueError: if ``dropout`` is non-zero or the shapes are inconsistent.
    """
    if dropout:
        raise ValueError("rowwise attention is inference-only (dropout must be 0)")
    batch, heads, n, head_dim = query.shape
    kv_heads, total = key.shape[1], key.shape[2]
    if heads % kv_heads or total < n:
        raise ValueError(f"rowwise attention: {heads} heads over {kv_heads} kv heads, {n} queries over {total} keys")
    groups = heads // kv_heads
    out = query.new_empty(batch, n, heads, head_dim)
    tree = attention_mask is not None and attention_mask.dim() == 4
    for i in range(n):
        q = query[:, :, i].reshape(batch, kv_heads, groups, head_dim)  # [b, kv, g, d]
        if tree:
            keys, values = _visible_keys(attention_mask[0, 0, i], key, value)
        else:
            end = total - n + i + 1  # keys [start, end) are visible to row i
            start = max(0, end - sliding_window) if sliding_window else 0
            keys, values = key[:, :, start:end], value[:, :, start:end]
        out[:, i] = _one_row(q, keys, values, scaling).reshape(batch, heads, head_dim)
    return out, None


def _visible_keys(row_mask: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values one row of a tree pass may see (``row_mask``: ``[L]``, bool True or additive 0 = visible),
    gathered in position order into the contiguous ``[b, kv, l, d]`` layout one-token decoding of that path
    would have, so the row's result is bit for bit the linear one (tested)."""
    visible = row_mask if row_mask.dtype == torch.bool else row_mask == 0
    index = visible.nonzero().flatten()  # [l]
    if int(index[-1]) + 1 == len(index):  # a prefix: slice, as the causal path does
        return key[:, :, : len(index)], value[:, :, : len(index)]
    return key.index_select(2, index), value.index_select(2, index)


def _one_row(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: float) -> torch.Tensor:
    """Attention of one position: q ``[b, kv, g, d]``, k/v ``[b, kv, l, d]`` -> ``[b, kv, g, d]``.

    ``k`` and ``v`` are prefixes (along l) of the cache tensors, so each ``[l, d]`` matrix has the same
    strides and start address whether the pass has one position or many; only the batch stride differs,
    which selects matrices and does not change how each product is computed (tested bit for bit).
    """
    scores = torch.matmul(q, k.transpose(-1, -2)).mul_(scaling)  # [b, kv, g, l]
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32)
    if probs.dtype != v.dtype:
        probs = probs.to(v.dtype)
    return torch.matmul(probs, v)


def _no_mask(*args, attention_mask: torch.Tensor | None = None, **kwargs) -> None:
    """Mask function for :data:`ROWWISE_ATTENTION`: no mask tensor is needed (causality comes from shapes).

    Raises:
        NotImplementedError: if a 2D padding mask hides any position (padded batches are not supported).
    """
    if attention_mask is not None and attention_mask.dim() == 2 and not bool(attention_mask.all()):
        raise NotImplementedError(f"{ROWWISE_ATTENTION} attention supports unpadded sequences only")
    return None


def register_rowwise_attention() -> str:
    """Register :func:`rowwise_attention` (and its mask function) with transformers under
    :data:`ROWWISE_ATTENTION`; idempotent. Returns the name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    if ROWWISE_ATTENTION not in AttentionInterface() or ROWWISE_ATTENTION not in AttentionMaskInterface():
        AttentionInterface.register(ROWWISE_ATTENTION, rowwise_attention)
        AttentionMaskInterface.register(ROWWISE_ATTENTION, _no_mask)
        logger.debug("registered %s attention with transformers", ROWWISE_ATTENTION)
    return ROWWISE_ATTENTION


def use_rowwise_attention(model: torch.nn.Module) -> None:
    """Switch a loaded transformers model to :func:`rowwise_attention` (registering it first).

    Raises:
        ValueError: if the model does not dispatch attention through ``AttentionInterface``.
    """
    name = register_rowwise_attention()
    if not hasattr(model, "set_attn_implementation"):
        raise ValueError(f"{type(model).__name__} is not a transformers model; cannot set its attention")
    model.set_attn_implementation(name)
    if getattr(model.config, "_attn_implementation", None) != name:
        raise ValueError(f"{type(model).__name__} does not support custom attention functions (AttentionInterface)")


# ------------------------------------------------------------------------------------ other per-position parts
class RowwiseActivation(nn.Module):
    """Applies an elementwise activation (SiLU, GELU...) to one position at a time.

    PyTorch evaluates transcendental functions with SIMD code over full vectors and scalar code over the
    remainder (and splits large tensors between threads), so an element's result can depend on where it falls
    in the flattened tensor, i.e. on how many positions share the call. One call per position reproduces
    one-token decoding exactly, whatever the width and thread count.

    Args:
        act: the activation module; input ``[..., n, features]``, output of the same shape.
    """

    def __init__(self, act: nn.Module) -> None:
        super().__init__()
        self.act = act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        if rows.shape[0] == 1:
            return self.act(x)
        out = torch.empty_like(rows)
        for i in range(rows.shape[0]):
            out[i] = self.act(rows[i:i + 1])[0]
        return out.reshape(x.shape)


class RowwiseRotary(nn.Module):
    """Computes a rotary embedding's ``(cos, sin)`` one position at a time (see :class:`RowwiseActivation`).

    Args:
        rotary: a transformers ``*RotaryEmbedding`` with ``forward(x, position_ids) -> (cos, sin)``, each
            ``[b, n, head_dim]``.
    """

    def __init__(self, rotary: nn.Module) -> None:
        super().__init__()
        self.rotary = rotary

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if position_ids.shape[-1] == 1:
            return self.rotary(x, position_ids)
        parts = [self.rotary(x, position_ids[..., j:j + 1]) for j in range(position_ids.shape[-1])]
        return torch.cat([cos for cos, _ in parts], dim=-2), torch.cat([sin for _, sin in parts], dim=-2)


def make_batch_invariant(model: nn.Module) -> int:
    """Make every per-position computation of a transformers decoder independent of the number of positions
    in the pass, apart from its linear layers (see :mod:`draftwise.backends.quantization` for those): row-wise
    attention, and :class:`RowwiseActivation` / :class:`RowwiseRotary` around MLP activations (``act_fn``
    attributes) and rotary embeddings (``rotary_emb`` attributes). Norms, residual adds and the embedding
    lookup already are (per-row reductions of fixed width, correctly rounded basic arithmetic, a lookup).
    Idempotent.

    Returns:
        The number of modules wrapped.

    Raises:
        ValueError: if the model does not dispatch attention through ``AttentionInterface``.
    """
    use_rowwise_attention(model)
    wrapped = 0
    for module in list(model.modules()):
        act = getattr(module, "act_fn", None)
        if isinstance(act, nn.Module) and not isinstance(act, RowwiseActivation):
            module.act_fn = RowwiseActivation(act)
            wrapped += 1
        rotary = getattr(module, "rotary_emb", None)
        if isinstance(rotary, nn.Module) and not isinstance(rotary, RowwiseRotary):
            module.rotary_emb = RowwiseRotary(rotary)
            wrapped += 1
    return wrapped
