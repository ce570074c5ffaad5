"""A compact Llama-family decoder (Llama, Qwen2 with q/k/v biases and tied heads, SmolLM2, stories260K) for
the CPU path, in the style of gpt-fast: fused projections, a preallocated slot KV cache, one forward over rows.

Built from a loaded ``transformers`` model's weights (the same files as the transformers backend), which it then
no longer needs. Every per-row computation is independent of the other rows of the pass, bit for bit:

- linear layers: :class:`draftwise.backends.quantization.Int8Linear` (int8, per-row activation scales, int32
  accumulation: exact) or float weights with rows zero-padded to the GEMM's invariant multiple;
- attention: :func:`draftwise.backends.lean.attention.block_attention` (fixed key blocks);
- rotary embeddings: one table of cos/sin for every position, computed once at load and gathered by position;
- norms, residual adds: per-row reductions of fixed width and elementwise arithmetic (checked by the
  load-time self-test :meth:`LeanLlama.check_row_invariance`, which :func:`draftwise.backends.lean.build_lean`
  runs on the real weights);
- SiLU: :func:`silu_rows`, on groups of rows small enough that no call is split between threads (ATen's
  vectorised and scalar SiLU differ in the last bit, and a thread split places a row's elements on either).

Shapes: n rows per pass, H hidden size, h query heads, kv KV heads, d head dim, I intermediate size, V vocab.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from draftwise import progress
from draftwise.backends.lean.attention import (
    block_attention,
    native_attention,
    native_attention_available,
    row_multiple,
    tree_block_attention,
)
from draftwise.backends.lean.kv_cache import SlotKVCache
from draftwise.backends.lean.rows import RowBatch, chain_rows

__all__ = ["LeanConfig", "LeanLlama", "UnsupportedArchitecture", "lean_config_from_hf", "silu_rows"]

logger = logging.getLogger(__name__)

#: transformers ``model_type`` values this implementation covers (decoder-only, RMSNorm, SwiGLU, RoPE).
SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "mistral")


class UnsupportedArchitecture(ValueError):
    """The model is not a plain Llama-family decoder this runtime implements (the transformers backend runs it)."""


@dataclass(frozen=True)
class LeanConfig:
    """Architecture of a Llama-family decoder.

    Attributes:
        vocab_size: logits width V; hidden_size: H; intermediate_size: I; num_layers; num_heads: h;
        num_kv_heads: kv; head_dim: d; rms_norm_eps; max_context (tokens); tie_word_embeddings;
        attention_bias: q/k/v projections carry biases (Qwen2).
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_context: int
    tie_word_embeddings: bool
    attention_bias: bool


def lean_config_from_hf(config, max_context: int | None = None) -> LeanConfig:
    """Read a transformers config.

    Raises:
        UnsupportedArchitecture: another model type, an active sliding window, a non-SiLU activation, MLP biases.
    """
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedArchitecture(f"model type {model_type!r} is not one of {SUPPORTED_MODEL_TYPES}")
    window = getattr(config, "sliding_window", None)
    if window and getattr(config, "use_sliding_window", True) is not False:
        raise UnsupportedArchitecture(f"sliding-window attention ({window} tokens) is not implemented")
    if getattr(config, "hidden_act", "silu") != "silu" or getattr(config, "mlp_bias", False):
        raise UnsupportedArchitecture("only SiLU-gated MLPs without biases are implemented")
    heads = int(config.num_attention_heads)
    return LeanConfig(
        vocab_size=int(config.vocab_size), hidden_size=int(config.hidden_size),
        intermediate_size=int(config.intermediate_size), num_layers=int(config.num_hidden_layers),
        num_heads=heads, num_kv_heads=int(getattr(config, "num_key_value_heads", None) or heads),
        head_dim=int(getattr(config, "head_dim", None) or config.hidden_size // heads),
        rms_norm_eps=float(config.rms_norm_eps),
        max_context=int(max_context or getattr(config, "max_position_embeddings", 2048)),
        tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
        attention_bias=model_type == "qwen2" or bool(getattr(config, "attention_bias", False)),
    )


#: builds a linear layer from a float weight ``[out, in]`` and bias ``[out]`` (or None); forward ``[m, in] ->
#: [m, out]`` float32, row-invariant.
LinearFactory = Callable[[torch.Tensor, torch.Tensor | None], nn.Module]


#: ATen runs an elementwise op over at most this many elements on one thread (``at::internal::GRAIN_SIZE``);
#: larger ones are split into equal ranges between the intra-op threads.
SERIAL_ELEMENTS = 32768


def silu_rows(gate: torch.Tensor) -> torch.Tensor:
    """SiLU of ``gate [n, I]`` (a row-strided view, such as the gate half of the fused gate/up projection),
    each row's bits independent of n.

    ATen's SiLU takes a vectorised path for most elements and a scalar one for a loop's remainder, and the two
    differ in the last bit for a few percent of inputs. One call over ``n x I`` elements above
    :data:`SERIAL_ELEMENTS` is split into equal element ranges between threads, so the row the split falls in
    (it moves with n) has other elements on the scalar path than it has alone: measured on stories260K (I =
    172, 2 threads), a 211-token prefill beside 8 other rows changed one row's MLP output and the greedy output
    of a served conversation. Here each call covers at most :data:`SERIAL_ELEMENTS` elements (one thread) of
    whole rows (or one row, when I is larger: every call then has the same shape), and a row-strided view is
    looped row by row, so every row takes the same paths whatever n is. (A model whose I is a multiple of 32
    on 2 threads was never affected: its split falls on a vector edge.)

    Returns:
        ``[n, I]`` float, contiguous.
    """
    n, width = gate.shape
    rows = max(1, (SERIAL_ELEMENTS - 1) // width)
    if n <= rows:
        return F.silu(gate)
    out = gate.new_empty(n, width)
    for part, into in zip(gate.split(rows), out.split(rows)):
        torch.ops.aten.silu.out(part, out=into)
    return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``[n, H] -> [n, H]``: x / rms(x) * weight (transformers' LlamaRMSNorm in fp32, as one fused op; a
    per-row reduction of fixed width, so row-invariant)."""
    return F.rms_norm(x, weight.shape, weight, eps)


@dataclass(frozen=True)
class SlotView:
    """What the rows of one slot attend to in a pass.

    Attributes:
        slot: the cache slot.
        rows: ``[g]`` indexes of the pass's rows in this slot.
        visible: ``[g, S]`` bool over the slot's keys ``[0, S)`` (S a multiple of the key block).
        tail_index, tail_visible: trees only: ``[g, T]`` cache indexes of each row's further keys in logical
            order (committed keys from S, then ancestors and itself) and their validity; None for chains.
        native_keys: the same keys for :func:`native_attention`, ``(prefix [g], tail [g, T], tail_len [g])``
            int64: the entries ``[0, prefix)`` in place, then the first ``tail_len`` of ``tail`` (a chain's row:
            its context length and no tail); built once per pass.
    """

    slot: int
    rows: torch.Tensor
    visible: torch.Tensor
    tail_index: torch.Tensor | None = None
    tail_visible: torch.Tensor | None = None
    native_keys: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None


class LeanLayer(nn.Module):
    """One decoder layer: RMSNorm, fused QKV, RoPE, block attention, output projection, RMSNorm, fused gate/up,
    SiLU, down projection, two residual adds."""

    def __init__(self, hf_layer, config: LeanConfig, linear: LinearFactory) -> None:
        super().__init__()
        attn, mlp = hf_layer.self_attn, hf_layer.mlp
        self.config = config
        self.input_norm = hf_layer.input_layernorm.weight.detach().float().clone()  # [H]
        self.post_norm = hf_layer.post_attention_layernorm.weight.detach().float().clone()  # [H]
        qkv_w = torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]).detach().float()
        qkv_b = None
        if attn.q_proj.bias is not None:
            qkv_b = torch.cat([attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias]).detach().float()
        self.qkv = linear(qkv_w, qkv_b)  # [n, H] -> [n, (h + 2 kv) d]
        self.o = linear(attn.o_proj.weight.detach().float(), None if attn.o_proj.bias is None else attn.o_proj.bias.detach().float())
        self.gate_up = linear(torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]).detach().float(), None)  # -> [n, 2I]
        self.down = linear(mlp.down_proj.weight.detach().float(), None)  # [n, I] -> [n, H]

    def forward(self, x: torch.Tensor, index: int, rows: RowBatch, cos: torch.Tensor, sin: torch.Tensor,
                cache: SlotKVCache, visibility: list[SlotView], block: int, multiple: int,
                native: bool = False) -> torch.Tensor:
        """``x [n, H] -> [n, H]``; writes the rows' keys/values into ``cache`` (layer ``index``). ``native``: the
        attention and the per-row operations run in the native extension (:meth:`_native_forward`; ``cos``,
        ``sin`` then ``[n, d]``, else ``[n, 1, d]``)."""
        c = self.config
        n = x.shape[0]
        if native:
            return self._native_forward(x, index, rows, cos, sin, cache, visibility)
        h = rms_norm(x, self.input_norm, c.rms_norm_eps)
        qkv = self.qkv(h)
        rotary_heads = c.num_heads + c.num_kv_heads
        qk = _rotate(qkv[:, : rotary_heads * c.head_dim].view(n, rotary_heads, c.head_dim), cos, sin)  # q and k
        q, k = qk[:, : c.num_heads], qk[:, c.num_heads :]
        v = qkv[:, rotary_heads * c.head_dim :].view(n, c.num_kv_heads, c.head_dim)
        cache.write(index, rows.slots, rows.cache_index, k, v)
        attended = torch.empty(n, c.num_heads, c.head_dim)
        scale = c.head_dim ** -0.5
        for view in visibility:
            keys, values = cache.keys[index][view.slot], cache.values[index][view.slot]  # [kv, capacity, d]
            if view.tail_index is None:
                length = view.visible.shape[1]
                attended[view.rows] = block_attention(q[view.rows], keys[:, :length], values[:, :length], view.visible,
                                                      scale=scale, block=block, multiple=multiple)
            else:
                attended[view.rows] = tree_block_attention(
                    q[view.rows], keys, values, view.visible, view.tail_index, view.tail_visible, scale=scale,
                    block=block, multiple=multiple)
        x = x + self.o(attended.view(n, c.num_heads * c.head_dim))
        h = rms_norm(x, self.post_norm, c.rms_norm_eps)
        gate, up = self.gate_up(h).split(c.intermediate_size, dim=-1)
        return x + self.down(silu_rows(gate).mul_(up))

    def _native_forward(self, x: torch.Tensor, index: int, rows: RowBatch, cos: torch.Tensor, sin: torch.Tensor,
                        cache: SlotKVCache, visibility: list[SlotView]) -> torch.Tensor:
        """:meth:`forward` with the per-row operations in the native extension (``kernels/lean_ops.cpp``) and
        :func:`native_attention`; ``cos``, ``sin`` ``[n, d]``."""
        c = self.config
        n = x.shape[0]
        ops = torch.ops.draftwise_native
        qkv = self.qkv(ops.rms_norm(x, self.input_norm, c.rms_norm_eps))
        q = ops.rope_write(qkv, cos, sin, cache.keys[index], cache.values[index], rows.slots, rows.cache_index,
                           c.num_heads, c.num_kv_heads)  # [n, h, d]; the keys and values are in the cache
        scale = c.head_dim ** -0.5
        if len(visibility) == 1:  # one slot: its rows are all the pass's rows, in order
            view = visibility[0]
            attended = native_attention(q, cache.keys[index][view.slot], cache.values[index][view.slot],
                                        *view.native_keys, scale=scale)
        else:
            attended = torch.empty(n, c.num_heads, c.head_dim)
            for view in visibility:
                attended[view.rows] = native_attention(q[view.rows], cache.keys[index][view.slot],
                                                       cache.values[index][view.slot], *view.native_keys, scale=scale)
        x = x + self.o(attended.view(n, c.num_heads * c.head_dim))
        return x + self.down(ops.silu_mul(self.gate_up(ops.rms_norm(x, self.post_norm, c.rms_norm_eps))))


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE (rotate-half convention): ``x [n, heads, d]``, ``cos``/``sin`` ``[n, 1, d]``."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class LeanLlama(nn.Module):
    """The decoder over rows of one or several sequences (see :mod:`draftwise.backends.lean.rows`).

    Args:
        hf_model: a loaded transformers ``LlamaForCausalLM`` / ``Qwen2ForCausalLM`` / ... on the CPU (read, not kept).
        linear: the linear-layer factory (int8 or float, row-invariant).
        max_context: context length (tokens); default the config's.
        num_slots: sequences the KV cache holds.
        block: attention key block (tokens).
        head_ids: compute the LM head over these vocabulary ids only, the others' logits being -inf (FR-Spec,
            Zhao et al. 2025, for draft models; :class:`draftwise.frspec.SubsetLMHead`); None = every id.
        native: run the attention (:func:`native_attention`) and the per-row operations between the linear
            layers (RMSNorm, rotary embedding and cache write, SiLU gate: ``kernels/lean_ops.cpp``) in the native
            extension, one call each; None = where it builds and loads (a C++ compiler), else in torch
            (:func:`block_attention`). Either gives row-invariant logits; their bits differ, and a model keeps
            one for its lifetime.
        kv_dtype: the KV cache's element type: None = fp16 on the native path (keys and values rounded to
            nearest even when written), fp32 on the torch path (which reads fp32 only).

    Raises:
        UnsupportedArchitecture: see :func:`lean_config_from_hf`.
        ValueError: ``kv_dtype`` other than fp32 on the torch path.
    """

    def __init__(self, hf_model, linear: LinearFactory, *, max_context: int | None = None, num_slots: int = 1,
                 block: int = 64, head_ids=None, native: bool | None = None,
                 kv_dtype: torch.dtype | None = None) -> None:
        super().__init__()
        config = lean_config_from_hf(hf_model.config, max_context)
        if native is None:
            reason = native_attention_available()
            native = reason is None
            if reason is not None:
                logger.info("attention and norms run in torch: the native extension is unavailable: %s", reason)
        self.native = bool(native)
        #: the KV cache's element type: by default fp16 on the native path (its attention widens it exactly; half
        #: the bytes a pass reads, as llama.cpp's default cache), fp32 on the torch path, which reads fp32 only
        self.kv_dtype = kv_dtype or (torch.float16 if self.native else torch.float32)
        if not self.native and self.kv_dtype != torch.float32:
            raise ValueError(f"the torch attention reads an fp32 cache, not {self.kv_dtype}")
        self.config = config
        self.block = block
        decoder = hf_model.model
        self.embed = decoder.embed_tokens.weight.detach().float().clone()  # [V, H]
        self.layers = nn.ModuleList(_build_layers(decoder.layers, config, linear))
        self.final_norm = decoder.norm.weight.detach().float().clone()  # [H]
        head = hf_model.get_output_embeddings()
        # [V, H] float, not kept: an untied head's weight is a view of the loaded checkpoint (a memory-mapped file
        # for a dequantized GGUF), and holding it would keep the whole mapping resident (6.8 GB for the 1.5B)
        head_weight = self.embed if config.tie_word_embeddings else head.weight.detach().float()
        head_bias = None if getattr(head, "bias", None) is None else head.bias.detach().float()
        if head_ids is None:
            self.lm_head = linear(head_weight, head_bias)  # [n, H] -> [n, V]
        else:
            from draftwise.frspec import SubsetLMHead

            self.lm_head = SubsetLMHead(head_weight, head_ids, vocab_size=config.vocab_size, bias=head_bias, kernel=linear)
        self.cos, self.sin = _rotary_tables(decoder.rotary_emb, config)  # [max_context, d] each
        self.cache = SlotKVCache(config.num_layers, num_slots, config.num_kv_heads, config.head_dim,
                                 config.max_context, block=block, dtype=self.kv_dtype)
        self.multiple = row_multiple(config.num_heads, config.num_kv_heads, config.head_dim, block,
                                     torch.get_num_threads())

    @torch.inference_mode()
    def forward_rows(self, rows: RowBatch, *, logit_rows: torch.Tensor | None = None,
                     hidden_rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Run the rows through the decoder, writing their keys/values into the slot cache.

        Args:
            rows: the pass (tokens, slots, positions, cache entries, visibility).
            logit_rows: indexes of the rows whose logits are wanted (``[m]``; default all).
            hidden_rows: indexes of the rows whose final hidden states are wanted (default none).

        Returns:
            ``(logits [m, V] float32, hidden [k, H] or None)``.

        Raises:
            ValueError: a cache entry at or past the context length.
        """
        top = int(rows.cache_index.max()) + 1
        if top > self.config.max_context:
            raise ValueError(f"cache entry {top - 1} outside a context of {self.config.max_context}")
        self.cache.ensure(top)
        x = F.embedding(rows.tokens, self.embed)  # [n, H]
        cos, sin = self.cos[rows.positions], self.sin[rows.positions]  # [n, d]
        if not self.native:
            cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # [n, 1, d]
        visibility = self._visibility(rows)
        for index, layer in enumerate(self.layers):
            x = layer(x, index, rows, cos, sin, self.cache, visibility, self.block, self.multiple, self.native)
        if self.native:
            x = torch.ops.draftwise_native.rms_norm(x, self.final_norm, self.config.rms_norm_eps)
        else:
            x = rms_norm(x, self.final_norm, self.config.rms_norm_eps)
        hidden = None if hidden_rows is None else x[hidden_rows]
        selected = x if logit_rows is None else x[logit_rows]
        if selected.shape[0] == 0:
            return x.new_empty(0, self.config.vocab_size), hidden
        return self.lm_head(selected), hidden

    def _visibility(self, rows: RowBatch) -> list[SlotView]:
        """Per slot in the pass, the rows and the keys they attend to (see :class:`SlotView`)."""
        views = []
        for slot in torch.unique(rows.slots).tolist():
            row_index = (rows.slots == slot).nonzero().flatten()
            context = rows.context_len[row_index]
            # a tree's rows see themselves through the mask; a chain's rows (mask rows all False) through the cache
            if rows.tree_mask is None or not bool(rows.tree_mask[row_index[0], row_index[0]]):
                length = _round_up(int(context.max()), self.block)
                visible = torch.arange(length)[None, :] < context[:, None]  # [g, L]
                no_tail = context.new_zeros(len(context), 0), context.new_zeros(len(context))
                views.append(SlotView(slot, row_index, visible, native_keys=(context, *no_tail)))
            else:
                views.append(self._tree_view(slot, row_index, rows))
        return views

    def _tree_view(self, slot: int, row_index: torch.Tensor, rows: RowBatch) -> SlotView:
        """Tree rows: shared blocks below the committed length's block edge, then per-row logical tails."""
        base = int(rows.context_len[row_index].min())
        shared = base // self.block * self.block
        entries = rows.cache_index[row_index]
        tree = rows.tree_mask[row_index][:, row_index]  # [g, g] ancestor-or-self
        tails = []
        extra = rows.extra_keys
        for r in range(len(row_index)):
            own = torch.arange(shared, int(rows.context_len[row_index[r]]))
            grown = torch.tensor(extra[int(row_index[r])], dtype=torch.long) if extra else own[:0]
            tails.append(torch.cat([own, grown, entries[tree[r]]]))
        width = _round_up(max(len(t) for t in tails), self.block)
        tail_index = torch.zeros(len(tails), width, dtype=torch.long)
        tail_visible = torch.zeros(len(tails), width, dtype=torch.bool)
        for r, tail in enumerate(tails):
            tail_index[r, : len(tail)] = tail
            tail_visible[r, : len(tail)] = True
        visible = torch.ones(len(tails), shared, dtype=torch.bool)
        prefix = torch.full((len(tails),), shared, dtype=torch.long)
        tail_len = torch.tensor([len(tail) for tail in tails], dtype=torch.long)
        return SlotView(slot, row_index, visible, tail_index, tail_visible, (prefix, tail_index, tail_len))

    @torch.inference_mode()
    def check_row_invariance(self, *, context: int = 70, max_rows: int = 9, slot: int = 0, seed: int = 0) -> bool:
        """Load-time self-test on the real weights: a chain of k = 1..``max_rows`` tokens on top of ``context``
        cached ones (crossing a key-block edge) gives every row the logits one-token decoding gives, bit for bit.
        In a context too short for that, fewer rows on fewer cached tokens (True when not even two rows fit).
        Uses ``slot`` and leaves it empty.

        Returns:
            True when every row matched.
        """
        max_rows = min(max_rows, self.config.max_context - 2)
        if max_rows < 2:
            return True  # no pass of several rows fits beside a cached token: nothing to compare
        context = max(1, min(context, self.config.max_context - max_rows - 1))
        generator = torch.Generator().manual_seed(seed)
        ids = torch.randint(0, self.config.vocab_size, (context + max_rows,), generator=generator).tolist()
        try:
            progress.report("row-invariance self-test", done=0, total=max_rows, unit="passes")
            self.forward_rows(chain_rows(ids[:context], 0, slot))
            alone = [self.forward_rows(chain_rows([t], context + i, slot))[0][0] for i, t in enumerate(ids[context:])]
            progress.report("row-invariance self-test", done=1, total=max_rows, unit="passes")
            for k in range(2, max_rows + 1):
                together, _ = self.forward_rows(chain_rows(ids[context:context + k], context, slot))
                progress.report("row-invariance self-test", done=k, total=max_rows, unit="passes")
                if not all(torch.equal(together[i], alone[i]) for i in range(k)):
                    logger.warning("row-invariance self-test failed at k=%d on %d cached tokens", k, context)
                    return False
            return True
        finally:
            self.cache.lengths[slot] = 0

    @torch.inference_mode()
    def check_thread_invariance(self, threads: int = 1, *, context: int = 70, rows: int = 9, slot: int = 0,
                                seed: int = 0) -> bool:
        """Whether the logits depend on the number of torch threads, on the real weights: a prompt of ``context``
        tokens and a chain of ``rows`` after it, computed with the current thread count and with ``threads``,
        must agree bit for bit (then the thread count may follow the machine's load without changing the
        output: :mod:`draftwise.cpu_share`). Uses ``slot`` and leaves it empty.

        Returns:
            True when every logit matched.
        """
        from draftwise.machine import torch_threads

        rows = max(1, min(rows, self.config.max_context - 2))
        context = max(1, min(context, self.config.max_context - rows - 1))
        generator = torch.Generator().manual_seed(seed)
        ids = torch.randint(0, self.config.vocab_size, (context + rows,), generator=generator).tolist()

        def passes() -> list[torch.Tensor]:
            try:
                prefill, _ = self.forward_rows(chain_rows(ids[:context], 0, slot))
                chain, _ = self.forward_rows(chain_rows(ids[context:], context, slot))
                return [prefill, chain]
            finally:
                self.cache.lengths[slot] = 0

        reference = passes()
        with torch_threads(threads):
            other = passes()
        return all(torch.equal(a, b) for a, b in zip(reference, other))

    def truncated(self, num_layers: int) -> LeanLlama:
        """A decoder made of this one's first ``num_layers`` layers (weights shared, not copied) with its own
        single-slot cache: a layer-skipping self-draft.

        Raises:
            ValueError: ``num_layers`` not in ``[1, num_layers)``.
        """
        import copy
        import dataclasses

        if not 1 <= num_layers < self.config.num_layers:
            raise ValueError(f"num_layers must be in [1, {self.config.num_layers}), got {num_layers}")
        draft = copy.copy(self)
        nn.Module.__init__(draft)
        draft.__dict__.update({k: v for k, v in self.__dict__.items() if k not in ("_modules", "_parameters", "_buffers")})
        draft.layers = nn.ModuleList(list(self.layers)[:num_layers])
        draft.lm_head = self.lm_head
        draft.config = dataclasses.replace(self.config, num_layers=num_layers)
        draft.cache = SlotKVCache(num_layers, 1, self.config.num_kv_heads, self.config.head_dim,
                                  self.config.max_context, block=self.block, dtype=self.kv_dtype)
        return draft

    def weight_bytes(self) -> int:
        """Bytes of the weights a one-token pass reads: linear layers (as stored by their kernel), norms, and
        one embedding row (the table is a lookup)."""
        total = 0
        for module in self.modules():
            if module is self:
                continue
            nbytes = getattr(module, "nbytes", None) or getattr(module, "weight_bytes", None)
            if callable(nbytes):
                total += int(nbytes())
            elif isinstance(nbytes, int):  # the kernels' modules: a property
                total += nbytes
            elif isinstance(module, nn.Linear):
                total += module.weight.numel() * module.weight.element_size()
        norms = sum(layer.input_norm.numel() + layer.post_norm.numel() for layer in self.layers)
        return total + 4 * (norms + self.final_norm.numel() + self.config.hidden_size)


def _build_layers(hf_layers, config: LeanConfig, linear: LinearFactory) -> list[LeanLayer]:
    """The lean copies of a transformers decoder's layers, one after the other (their linear layers built by
    ``linear``: int8 quantization for the int8 mode), reporting progress per layer."""
    layers = []
    total = len(hf_layers)
    progress.report("building the lean decoder", done=0, total=total, unit="layers")
    for index, hf_layer in enumerate(hf_layers, 1):
        layers.append(LeanLayer(hf_layer, config, linear))
        progress.report("building the lean decoder", done=index, total=total, unit="layers")
    return layers


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def _rotary_tables(rotary: nn.Module, config: LeanConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin ``[max_context, d]`` for every position, computed once in one call (as transformers'
    rotary embedding computes them), so a position's values never depend on the pass it appears in."""
    positions = torch.arange(config.max_context, dtype=torch.long)[None]  # [1, P]
    probe = torch.zeros(1, dtype=torch.float32)
    with torch.no_grad():
        cos, sin = rotary(probe, positions)
    return cos[0].float().contiguous(), sin[0].float().contiguous()
