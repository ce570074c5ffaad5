"""Medusa heads (Cai et al. 2024, "Medusa: Simple LLM Inference Acceleration Framework with Multiple Decoding
Heads", https://arxiv.org/abs/2401.10774; reference code FasterDecoding/Medusa).

Head i is ``num_layers`` residual blocks ``x + SiLU(W x + b)`` on the target's last hidden state h_t (after
the final norm), followed by the target's own LM head (shared, frozen, not stored with the heads). With the
target's LM head predicting token t+1 from h_t, head i predicts token t+2+i. The block weights start at zero,
so an untrained head repeats the target's next-token prediction (as in the reference code).
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["MedusaHeads", "ResBlock"]


class ResBlock(nn.Module):
    """``x + SiLU(linear(x))`` with ``linear`` zero-initialised. Shapes: ``[..., H] -> [..., H]``."""

    def __init__(self, hidden_size: int) -> None:
        super().__init__()
        self.linear = nn.Linear(hidden_size, hidden_size)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)
        self.act = nn.SiLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.act(self.linear(x))


class MedusaHeads(nn.Module):
    """``num_heads`` Medusa heads of ``num_layers`` residual blocks each.

    Args:
        hidden_size: H of the base model.
        num_heads: number of heads (draft depth they cover).
        num_layers: residual blocks per head.
    """

    def __init__(self, hidden_size: int, num_heads: int, num_layers: int = 1) -> None:
        super().__init__()
        if num_heads < 1 or num_layers < 1:
            raise ValueError("num_heads and num_layers must be >= 1")
        self.hidden_size = hidden_size
        self.num_heads = num_heads
        self.num_layers = num_layers
        self.blocks = nn.ModuleList(
            nn.Sequential(*[ResBlock(hidden_size) for _ in range(num_layers)]) for _ in range(num_heads)
        )

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """Head features.

        Args:
            hidden: ``[..., H]`` target last hidden states (after the final norm).

        Returns:
            ``[num_heads, ..., H]``; apply the target's LM head to get ``[num_heads, ..., vocab]`` logits.
        """
        return torch.stack([block(hidden) for block in self.blocks])
