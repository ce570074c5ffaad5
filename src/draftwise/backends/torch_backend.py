"""PyTorch / transformers backend: a ``transformers`` causal LM with a ``DynamicCache``.

Rollback uses ``DynamicCache.crop`` (as Hugging Face assisted generation does). Default dtype: fp32, and bf16 for
a draft model on a GPU (see :func:`default_dtype`).
"""

from __future__ import annotations

import contextlib
import inspect
import logging
from collections.abc import Sequence

import torch

from draftwise.backends.base import CausalLM, ForwardOutput, KVState
from draftwise.tree import check_parents, tree_attention_mask, tree_position_ids

__all__ = ["TorchCausalLM", "attention_backends", "default_attention", "default_device", "default_dtype"]

logger = logging.getLogger(__name__)


def default_device() -> str:
    """``"cuda"`` when a CUDA device is present, else ``"cpu"``."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def default_attention(device: str) -> str:
    """Attention kernel: ``"sdpa"`` on GPU; ``"eager"`` on CPU, where torch's SDPA is far slower for the short
    single-sequence decode and verify passes this engine runs (figures in ``docs/cpu_int8.md``)."""
    return "sdpa" if device.startswith("cuda") else "eager"


def attention_backends(device: torch.device | str) -> list | None:
    """The SDPA kernels a pass on ``device`` may use: on CUDA, flash, memory-efficient and math attention, not
    cuDNN's; None (PyTorch's choice) elsewhere.

    PyTorch 2.11 picks cuDNN's attention for bf16 on Hopper, and cuDNN builds an execution plan for each new
    shape. Decoding changes the key length every pass, so every pass would pay for a plan, several times the
    pass itself (figures in ``docs/gpu.md``).
    """
    if torch.device(device).type != "cuda":
        return None
    from torch.nn.attention import SDPBackend

    return [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def default_dtype(device: str, *, drafting: bool = False) -> torch.dtype:
    """fp32, except bf16 for a draft model (``drafting``) on a GPU.

    A target computes in fp32 on a GPU too: transformers' bf16 kernels there are not row-invariant, so a
    verify pass rounds a token's logits differently from the one-token pass of plain decoding, and the output
    changes where the top logits nearly tie; fp32 is not proven row-invariant on a GPU, but its logits move by
    far less (``scripts/bench/gpu_check.py`` measures both; its results are in ``docs/gpu.md``). A draft's
    numerics never change the output, so a GPU draft keeps bf16's speed.
    On the CPU bf16 is slow without AVX512-BF16 and the exact int8 / Q4_K runtimes compute in fp32.
    """
    return torch.bfloat16 if drafting and device.startswith("cuda") else torch.float32


class TorchCausalLM(CausalLM):
    """Wraps a loaded ``transformers`` ``*ForCausalLM`` module as a :class:`CausalLM`.

    Args:
        model: the module (already on its device and dtype, in eval mode).
        name: identity used in messages.
        max_context: context length in tokens (default: ``config.max_position_embeddings``).
    """

    def __init__(self, model: torch.nn.Module, name: str = "model", max_context: int | None = None) -> None:
        from transformers import DynamicCache

        self.model = model.eval()
        self.name = name
        config = model.config
        self.vocab_size = int(model.get_output_embeddings().weight.shape[0])
        self.max_context = int(max_context or getattr(config, "max_position_embeddings", 2048))
        self.hidden_size = int(config.hidden_size)
        self.device = next(model.parameters()).device
        self._cache_cls = DynamicCache
        self._cache = DynamicCache(config=config)
        self._num_cached = 0
        # transformers >= 5.2x names the cache argument `cache`; older releases `past_key_values`.
        params = inspect.signature(type(model).forward).parameters
        self._cache_arg = "cache" if "cache" in params else "past_key_values"
        self._attention_backends = attention_backends(self.device)
        self.sliding_window = _active_sliding_window(config)
        # A tree pass builds its own mask over every cached key; a window shorter than the context would be
        # ignored there, so trees are refused on such models (chains go through the model's own masks).
        self.supports_tree = self.sliding_window is None or self.sliding_window >= self.max_context
        # Exported caches are shared tensors: possible only with plain (non-sliding) dynamic layers.
        self.supports_cache_export = all(type(layer).__name__ == "DynamicLayer" for layer in self._cache.layers)

    @property
    def num_cached(self) -> int:
        return self._num_cached

    @torch.inference_mode()
    def forward(
        self, token_ids: Sequence[int], *, num_logits: int | None = None, return_hidden: bool = False,
        hidden_rows: int | None = None,
    ) -> ForwardOutput:
        token_ids = list(token_ids)
        self._check_forward_args(token_ids)
        n = len(token_ids)
        keep = n if num_logits is None else max(1, min(num_logits, n))
        positions = torch.arange(self._num_cached, self._num_cached + n, device=self.device)
        out = self._run(token_ids, positions, keep, return_hidden)
        self._num_cached += n
        rows = keep if hidden_rows is None else max(1, min(hidden_rows, n))
        return self._output(out, keep, rows if return_hidden else 0)

    @torch.inference_mode()
    def forward_tree(self, token_ids: Sequence[int], parents: Sequence[int], *, return_hidden: bool = False) -> ForwardOutput:
        token_ids = list(token_ids)
        if not self.supports_tree:
            raise NotImplementedError(
                f"{self.name}: draft trees are not supported on a model with a {self.sliding_window}-token sliding "
                f"window shorter than its {self.max_context}-token context (use a chain: tree_width 1)")
        self._check_forward_args(token_ids)
        if len(parents) != len(token_ids) - 1:
            raise ValueError(f"{len(token_ids)} tree tokens (root included) need {len(token_ids) - 1} parents, got {len(parents)}")
        check_parents(parents)
        n = len(token_ids)
        visible = tree_attention_mask(parents, self._num_cached).to(self.device)  # [n, cached + n]
        dtype = next(self.model.parameters()).dtype
        mask = torch.zeros(visible.shape, dtype=dtype, device=self.device).masked_fill_(~visible, torch.finfo(dtype).min)
        positions = tree_position_ids(parents, self._num_cached).to(self.device)  # [n]
        cache_positions = torch.arange(self._num_cached, self._num_cached + n, device=self.device)
        out = self._run(token_ids, positions, n, return_hidden, mask=mask[None, None], cache_positions=cache_positions)
        self._num_cached += n
        return self._output(out, n, n if return_hidden else 0)

    def compact(self, base: int, keep: Sequence[int]) -> None:
        keep = [int(j) for j in keep]
        if not 0 <= base <= self._num_cached or any(b <= a for a, b in zip(keep, keep[1:])) or \
                (keep and (keep[0] < 0 or base + keep[-1] >= self._num_cached)):
            raise ValueError(f"compact({base}, {keep}) outside a cache of {self._num_cached} entries")
        if keep == list(range(len(keep))):  # a prefix: a plain rollback
            self.rollback(base + len(keep))
            return
        index = torch.tensor(list(range(base)) + [base + j for j in keep], dtype=torch.long, device=self.device)
        for layer in self._cache.layers:
            layer.keys = layer.keys.index_select(-2, index)
            layer.values = layer.values.index_select(-2, index)
        self._num_cached = len(index)

    supports_hidden_states = True

    def export_cache(self) -> KVState:
        """The cache's per-layer ``(keys, values)`` tensors (``[1, kv_heads, num_cached, head_dim]``), shared,
        not copied: this backend never writes cache tensors in place (``DynamicLayer.update`` concatenates,
        crop slices, :meth:`compact` gathers into new tensors)."""
        if not self.supports_cache_export:
            raise NotImplementedError(f"{self.name}: the KV cache has sliding-window layers; it cannot be exported")
        if self._num_cached == 0:
            return KVState(payload=(), length=0, nbytes=0)
        payload = tuple((layer.keys, layer.values) for layer in self._cache.layers)
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for pair in payload for t in pair}
        return KVState(payload=payload, length=self._num_cached, nbytes=sum(storages.values()))

    def import_cache(self, state: KVState, length: int) -> None:
        if not self.supports_cache_export:
            raise NotImplementedError(f"{self.name}: the KV cache has sliding-window layers; it cannot be imported")
        if not 0 <= length <= state.length:
            raise ValueError(f"import length {length} outside [0, {state.length}]")
        if length == 0:
            self.reset()
            return
        if len(state.payload) != len(self._cache.layers):
            raise ValueError(f"{self.name}: a KV state of {len(state.payload)} layers for a {len(self._cache.layers)}-layer model")
        cache = self._cache_cls(config=self.model.config)
        for layer, (keys, values) in zip(cache.layers, state.payload):
            layer.lazy_initialization(keys, values)
            layer.keys = keys[..., :length, :]
            layer.values = values[..., :length, :]
        self._cache = cache
        self._num_cached = length

    def _run(self, token_ids: list[int], positions: torch.Tensor, keep: int, return_hidden: bool, *,
             mask: torch.Tensor | None = None, cache_positions: torch.Tensor | None = None):
        input_ids = torch.tensor([token_ids], dtype=torch.long, device=self.device)  # [1, n]
        extra = {} if mask is None else {"attention_mask": mask}  # [1, 1, n, cached + n] additive
        with self._attention_kernels():
            return self.model(
                input_ids=input_ids,
                position_ids=positions.unsqueeze(0),  # [1, n]
                cache_position=positions if cache_positions is None else cache_positions,  # [n]
                **{self._cache_arg: self._cache},
                use_cache=True,
                logits_to_keep=keep,
                output_hidden_states=return_hidden,
                **extra,
            )

    def _attention_kernels(self):
        """The SDPA kernels this device's passes may use (:func:`attention_backends`)."""
        if self._attention_backends is None:
            return contextlib.nullcontext()
        from torch.nn.attention import sdpa_kernel

        return sdpa_kernel(self._attention_backends)

    def _output(self, out, keep: int, hidden_rows: int) -> ForwardOutput:
        logits = out.logits[0, -keep:].float()  # [keep, vocab]
        hidden = out.hidden_states[-1][0, -hidden_rows:].float() if hidden_rows else None  # [rows, hidden]
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return ForwardOutput(logits=logits.cpu(), hidden=None if hidden is None else hidden.cpu())

    def rollback(self, length: int) -> None:
        self._check_rollback_args(length)
        if length == self._num_cached:
            return
        if length == 0:
            self._cache = self._cache_cls(config=self.model.config)
        else:
            # A negative argument removes that many tokens in every transformers release (4.x read a positive
            # one as the new length; 5.x rejects it).
            self._cache.crop(length - self._num_cached)
        self._num_cached = length


def _active_sliding_window(config) -> int | None:
    """The attention window (tokens) the model's config enables, or None (full attention). Qwen2-style configs
    carry ``sliding_window`` with ``use_sliding_window: false``; Mistral-style ones set only ``sliding_window``."""
    window = getattr(config, "sliding_window", None)
    if not window or getattr(config, "use_sliding_window", True) is False:
        return None
    return int(window)
