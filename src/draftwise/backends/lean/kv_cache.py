"""A preallocated KV cache indexed by position, one region per sequence slot (gpt-fast style).

Each layer holds keys and values ``[slots, kv_heads, capacity, head_dim]``; a row's key/value is written in
place at its ``cache_index``. Rolling a sequence back is setting its length: entries past it are ignored (and
overwritten by the next pass), so nothing is concatenated or copied per step. Capacity grows in whole key blocks
(doubling, copied once) up to the model's context length, so a short sequence does not reserve 32k positions.

Unused entries are zeros, never uninitialised memory: attention multiplies masked probabilities (exact zeros)
by the values of whole key blocks, and 0 * NaN would poison a row.

The cache's tensors are always ordinary tensors, never inference tensors, whatever mode the caller runs in:
the cache grows inside the model's ``torch.inference_mode()`` forward, while prefix reuse, tree compaction and
other slot operations write into it outside that mode, and PyTorch refuses an in-place update of an inference
tensor outside inference mode. In-place writes into ordinary tensors are allowed in both modes, so allocating
(and growing) with inference mode switched off makes every write path legal.
"""

from __future__ import annotations

import torch

from draftwise.backends.base import KVState

__all__ = ["SlotKVCache"]


class SlotKVCache:
    """Keys and values of ``num_layers`` layers for ``num_slots`` sequences.

    Args:
        num_layers, num_slots, kv_heads, head_dim: shape of the cache.
        max_context: the most positions a slot may hold (tokens).
        block: capacity granularity (tokens); the attention's key block size.
        dtype: storage dtype (fp32 on the exact CPU path).

    Attributes:
        lengths: ``[num_slots]`` committed length of each slot (tokens), kept by the owner of the slot.
    """

    def __init__(self, num_layers: int, num_slots: int, kv_heads: int, head_dim: int, max_context: int, *,
                 block: int, dtype: torch.dtype = torch.float32, initial: int = 1024) -> None:
        self.num_layers, self.num_slots, self.kv_heads, self.head_dim = num_layers, num_slots, kv_heads, head_dim
        self.block = block
        self.max_capacity = _round_up(max_context, block)
        self.dtype = dtype
        self.capacity = min(self.max_capacity, _round_up(max(initial, block), block))
        self.keys = [self._zeros(self.capacity) for _ in range(num_layers)]
        self.values = [self._zeros(self.capacity) for _ in range(num_layers)]
        self.lengths = [0] * num_slots

    def _zeros(self, capacity: int) -> torch.Tensor:
        """A zeroed ``[num_slots, kv_heads, capacity, head_dim]`` ordinary tensor (see the module docstring)."""
        with torch.inference_mode(False):
            return torch.zeros(self.num_slots, self.kv_heads, capacity, self.head_dim, dtype=self.dtype)

    @property
    def bytes_per_token(self) -> int:
        """Bytes one position of one slot occupies over all layers (keys and values)."""
        return 2 * self.num_layers * self.kv_heads * self.head_dim * torch.finfo(self.dtype).bits // 8

    def nbytes(self) -> int:
        """Bytes allocated now (all slots, all layers)."""
        return self.bytes_per_token * self.num_slots * self.capacity

    def ensure(self, positions: int) -> None:
        """Make room for ``positions`` entries per slot (rounded up to a whole block; doubling growth).

        Raises:
            ValueError: ``positions`` beyond the context length.
        """
        needed = _round_up(positions, self.block)
        if needed <= self.capacity:
            return
        if needed > self.max_capacity:
            raise ValueError(f"{positions} positions exceed the cache's maximum of {self.max_capacity}")
        capacity = min(self.max_capacity, max(needed, 2 * self.capacity))
        with torch.inference_mode(False):  # the grown tensors stay ordinary tensors
            for store in (self.keys, self.values):
                for i, old in enumerate(store):
                    new = self._zeros(capacity)
                    new[:, :, : self.capacity] = old
                    store[i] = new
        self.capacity = capacity

    def write(self, layer: int, slots: torch.Tensor, index: torch.Tensor, keys: torch.Tensor,
              values: torch.Tensor) -> None:
        """Store rows' keys and values: ``keys``/``values`` ``[n, kv_heads, head_dim]`` at ``(slots[r],
        index[r])`` (``[n]`` each)."""
        self.keys[layer][slots, :, index] = keys
        self.values[layer][slots, :, index] = values

    def export_slot(self, slot: int, length: int) -> tuple[tuple[torch.Tensor, torch.Tensor], ...]:
        """Copies of the first ``length`` entries of a slot: per layer ``(keys, values)`` ``[kv_heads, length,
        head_dim]`` (the cache itself is written in place, so an export must copy)."""
        return tuple((k[slot, :, :length].clone(), v[slot, :, :length].clone()) for k, v in zip(self.keys, self.values))

    def import_slot(self, slot: int, payload, length: int) -> None:
        """Write the first ``length`` entries of an exported payload into a slot (and set its length)."""
        self.ensure(length)
        for (k, v), keys, values in zip(payload, self.keys, self.values):
            keys[slot, :, :length] = k[:, :length]
            values[slot, :, :length] = v[:, :length]
        self.lengths[slot] = length

    def export_state(self, slot: int, length: int) -> KVState:
        """:meth:`export_slot` as a :class:`~draftwise.backends.base.KVState` (with the bytes it keeps alive)."""
        payload = self.export_slot(slot, length)
        return KVState(payload, length, sum(k.nbytes + v.nbytes for k, v in payload))

    def keep_path(self, slot: int, base: int, keep) -> None:
        """Keep a slot's first ``base`` entries and the entries ``base + j`` for ``j`` in ``keep`` (increasing
        offsets into the last pass), packed after them, and set its length: a verified tree's accepted path (a
        prefix ``keep`` is a rollback)."""
        keep = [int(j) for j in keep]
        if keep != list(range(len(keep))):
            self.move_entries(slot, torch.tensor([base + j for j in keep]), base)
        self.lengths[slot] = base + len(keep)

    def move_entries(self, slot: int, source: torch.Tensor, dest: int) -> None:
        """Copy a slot's entries ``source`` (``[m]`` indexes) to positions ``dest..dest+m-1`` (tree compaction:
        the accepted path's entries packed after the committed prefix). Overlap is safe (gather first)."""
        m = int(source.shape[0])
        for store in (self.keys, self.values):
            for tensor in store:
                tensor[slot, :, dest : dest + m] = tensor[slot, :, source]


def _round_up(value: int, multiple: int) -> int:
    return -(-int(value) // multiple) * multiple
