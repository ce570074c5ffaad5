"""What a target plus draft pair costs in memory, computed before any weights are loaded.

- weights: parameters x bytes per parameter of the dtype the models will run in (a GGUF model is
  dequantized to that dtype, so its file size says nothing about its resident size);
- KV cache: bytes per token of each model (``2 * layers * kv_heads * head_dim * dtype bytes``), times the
  context length, times the number of concurrent sequences. The draft keeps its own cache as long as the
  target's context;
- the total against a budget: ``--memory-budget``, else the memory free on the device now.

Not included: activations and logits of one forward pass (small at batch 1), the CUDA context and allocator
fragmentation (plan a few hundred MiB of headroom on a GPU).
"""

from __future__ import annotations

import logging
import os
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from draftwise.check.describe import ModelDescription
from draftwise.units import format_bytes

__all__ = [
    "MemoryReport",
    "MemoryBudgetError",
    "available_memory",
    "dtype_bytes",
    "estimate_memory",
]

logger = logging.getLogger(__name__)


class MemoryBudgetError(RuntimeError):
    """The pair does not fit in the memory budget; nothing was loaded."""


def dtype_bytes(dtype: torch.dtype) -> int:
    """Bytes per element of a torch dtype (fp32: 4, bf16/fp16: 2)."""
    return torch.empty((), dtype=dtype).element_size()


def available_memory(device: str) -> tuple[int, str] | None:
    """Memory free for new models on ``device`` now, in bytes, with a description; None when unknown.

    CUDA: ``torch.cuda.mem_get_info``; CPU: ``MemAvailable`` of ``/proc/meminfo`` (Linux), else the free
    physical pages.

    Raises:
        ValueError: a CUDA device when CUDA is not available.
    """
    if device.startswith("cuda"):
        if not torch.cuda.is_available():
            raise ValueError(f"device {device!r} requested but CUDA is not available here")
        free, total = torch.cuda.mem_get_info(torch.device(device))
        return int(free), f"free on {device} (of {format_bytes(total)})"
    ram = available_ram()
    return None if ram is None else (ram, "available RAM")


def available_ram(meminfo: str | Path = "/proc/meminfo", cgroup: str | Path = "/sys/fs/cgroup") -> int | None:
    """RAM this process can get for new allocations now without swapping or being killed, in bytes; None when
    unknown.

    The machine's: ``MemAvailable`` of ``meminfo`` (Linux; free memory plus the page cache the kernel can
    reclaim, in kiB), else the free physical pages (``os.sysconf``). Within a memory-limited container (cgroup v2
    ``memory.max`` / ``memory.current``, or v1 ``memory/memory.limit_in_bytes`` / ``memory.usage_in_bytes`` under
    ``cgroup``), at most the limit less what the group uses. Never raises: an unreadable or odd file falls
    through to the next source.
    """
    machine = _meminfo_available(meminfo)
    if machine is None:
        try:
            machine = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError, AttributeError):
            machine = None
    group = _cgroup_headroom(Path(cgroup))
    if group is None:
        return machine
    return group if machine is None else min(machine, group)


def _meminfo_available(meminfo: str | Path) -> int | None:
    try:
        with open(meminfo, encoding="ascii") as lines:
            for line in lines:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError, UnicodeDecodeError):
        pass
    return None


def _cgroup_headroom(root: Path) -> int | None:
    """A memory-limited cgroup's limit less its usage (bytes, >= 0); None without a limit (``max``, v1's
    near-2**63 "unlimited") or when the files cannot be read."""
    for limit_file, usage_file in (("memory.max", "memory.current"),
                                   ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes")):
        try:
            limit_text = (root / limit_file).read_text().strip()
            usage = int((root / usage_file).read_text().strip())
        except (OSError, ValueError, UnicodeDecodeError):
            continue
        if not limit_text.isdigit() or int(limit_text) >= 1 << 60:
            return None  # the group has no limit
        return max(0, int(limit_text) - usage)
    return None


@dataclass(frozen=True)
class MemoryReport:
    """Memory of a target + draft pair, in bytes.

    Attributes:
        dtype: the dtype the target runs in (e.g. ``"float32"``); ``bytes_per_param``: its size.
        draft_dtype: the draft's (bf16 on a GPU by default); ``draft_bytes_per_param``: its size.
        context_len: tokens per sequence; ``num_seqs``: concurrent sequences.
        target_weights, draft_weights: weight bytes.
        target_kv_per_token, draft_kv_per_token: KV-cache bytes per token.
        target_kv, draft_kv: KV-cache bytes at ``context_len * num_seqs`` tokens.
        draft_total: what adding the draft costs (its weights and cache).
        total: everything.
        budget: the budget (None: unknown, not checked); ``budget_source``: where it came from.
        fits: ``total <= budget`` (None without a budget).
    """

    dtype: str
    bytes_per_param: int
    draft_dtype: str
    draft_bytes_per_param: int
    context_len: int
    num_seqs: int
    target_weights: int
    draft_weights: int
    target_kv_per_token: int
    draft_kv_per_token: int
    target_kv: int
    draft_kv: int
    draft_total: int
    total: int
    budget: int | None
    budget_source: str
    fits: bool | None

    @property
    def headroom(self) -> int | None:
        """``budget - total`` (negative when it does not fit), None without a budget."""
        return None if self.budget is None else self.budget - self.total

    def summary(self) -> str:
        """One line: total vs budget, and the draft's share."""
        line = f"needs {format_bytes(self.total)} (draft adds {format_bytes(self.draft_total)})"
        if self.budget is None:
            return line + "; no budget known"
        verdict = "fits" if self.fits else "does not fit"
        return f"{line}; {verdict} in {format_bytes(self.budget)} ({self.budget_source})"

    def to_dict(self) -> dict:
        """JSON-ready copy, headroom included."""
        return {**asdict(self), "headroom": self.headroom}


def estimate_memory(
    target: ModelDescription,
    draft: ModelDescription,
    *,
    dtype: torch.dtype,
    context_len: int,
    num_seqs: int = 1,
    draft_dtype: torch.dtype | None = None,
    budget: int | None = None,
    budget_source: str = "--memory-budget",
) -> MemoryReport:
    """Weights and KV cache of both models at ``context_len`` tokens x ``num_seqs`` sequences, vs ``budget``; the
    target in ``dtype``, the draft in ``draft_dtype`` (default: ``dtype``).

    Raises:
        ValueError: ``context_len`` or ``num_seqs`` below 1.
    """
    if context_len < 1 or num_seqs < 1:
        raise ValueError(f"context length and concurrency must be >= 1, got {context_len} and {num_seqs}")
    draft_dtype = dtype if draft_dtype is None else draft_dtype
    size, draft_size = dtype_bytes(dtype), dtype_bytes(draft_dtype)
    tokens = context_len * num_seqs
    target_weights, draft_weights = target.weight_bytes(size), draft.weight_bytes(draft_size)
    target_kv_token, draft_kv_token = target.kv_bytes_per_token(size), draft.kv_bytes_per_token(draft_size)
    draft_total = draft_weights + draft_kv_token * tokens
    total = target_weights + target_kv_token * tokens + draft_total
    return MemoryReport(
        dtype=str(dtype).removeprefix("torch."), bytes_per_param=size,
        draft_dtype=str(draft_dtype).removeprefix("torch."), draft_bytes_per_param=draft_size,
        context_len=context_len, num_seqs=num_seqs,
        target_weights=target_weights, draft_weights=draft_weights, target_kv_per_token=target_kv_token,
        draft_kv_per_token=draft_kv_token, target_kv=target_kv_token * tokens, draft_kv=draft_kv_token * tokens,
        draft_total=draft_total, total=total, budget=budget, budget_source=budget_source if budget is not None else "",
        fits=None if budget is None else total <= budget,
    )
