"""The EAGLE draft head (Li et al. 2024, "EAGLE: Speculative Sampling Requires Rethinking Feature
Uncertainty", https://arxiv.org/abs/2401.15077; reference code SafeAILab/EAGLE; EAGLE-2's dynamic draft tree:
https://arxiv.org/abs/2406.16858).

EAGLE drafts at the feature level. At position j it takes the target's feature f_j (last hidden state, after
the final norm) and the embedding of the token x_{j+1} that follows, fuses them with ``fc`` (``[2H] -> [H]``)
and runs one Llama-style decoder layer over the sequence of such pairs; the output is the predicted next
feature f_{j+1}, and the target's LM head (shared, frozen) turns it into draft logits for x_{j+2}. Drafting
deeper feeds the head its own predicted features.

As in the reference code (and vLLM's ``llama_eagle``), the decoder layer has no input norm and there is no
final norm. The layer keeps its own KV cache (:class:`HeadCache`); attention takes an explicit boolean mask so
the proposer can expand a draft tree in one pass per depth. Parameter names follow Llama
(``layers.0.self_attn.q_proj`` ...), which keeps the vLLM export a renaming-free copy.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["EagleHead", "EagleLayerConfig", "HeadCache", "eagle_layer_config"]


def eagle_layer_config(base_config) -> dict:
    """The decoder-layer sizes of an EAGLE head for a ``transformers`` base config (Llama, Qwen2, SmolLM...).

    Returns:
        dict with ``intermediate_size``, ``num_attention_heads``, ``num_key_value_heads``, ``head_dim``,
        ``rms_norm_eps``, ``rope_theta``, ``attention_bias`` (the :class:`HeadsConfig.eagle` field).
    """
    heads = int(base_config.num_attention_heads)
    head_dim = getattr(base_config, "head_dim", None) or base_config.hidden_size // heads
    rope = getattr(base_config, "rope_parameters", None) or {}
    theta = rope.get("rope_theta") if isinstance(rope, dict) else None
    theta = theta or getattr(base_config, "rope_theta", None) or 10000.0
    bias = getattr(base_config, "attention_bias", None)
    if bias is None:
        bias = getattr(base_config, "model_type", "") == "qwen2"
    return {
        "intermediate_size": int(base_config.intermediate_size),
        "num_attention_heads": heads,
        "num_key_value_heads": int(getattr(base_config, "num_key_value_heads", None) or heads),
        "head_dim": int(head_dim),
        "rms_norm_eps": float(getattr(base_config, "rms_norm_eps", 1e-6)),
        "rope_theta": float(theta),
        "attention_bias": bool(bias),
    }


EagleLayerConfig = dict


class HeadCache:
    """KV cache of the head's single layer: keys and values ``[kv_heads, length, head_dim]``."""

    def __init__(self) -> None:
        self.keys: torch.Tensor | None = None
        self.values: torch.Tensor | None = None

    def __len__(self) -> int:
        return 0 if self.keys is None else int(self.keys.shape[1])

    def append(self, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append ``[kv_heads, n, head_dim]`` keys/values; return the full cache."""
        if self.keys is None:
            self.keys, self.values = keys, values
        else:
            self.keys = torch.cat([self.keys, keys], dim=1)
            self.values = torch.cat([self.values, values], dim=1)
        return self.keys, self.values

    def crop(self, length: int) -> None:
        """Keep the first ``length`` entries (0 <= length <= len(self)).

        Raises:
            ValueError: length out of range.
        """
        if not 0 <= length <= len(self):
            raise ValueError(f"crop length {length} outside [0, {len(self)}]")
        if length == 0:
            self.keys = self.values = None
        else:
            self.keys, self.values = self.keys[:, :length], self.values[:, :length]


class _RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


class _Attention(nn.Module):
    def __init__(self, hidden: int, cfg: dict) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
        bias = cfg["attention_bias"]
        self.q_proj = nn.Linear(hidden, self.heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(hidden, self.kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden, self.kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.heads * self.head_dim, hidden, bias=False)
        inv_freq = 1.0 / (cfg["rope_theta"] ** (torch.arange(0, self.head_dim, 2, dtype=torch.float32) / self.head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def _rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        freqs = positions.float()[:, None] * self.inv_freq[None, :]  # [n, head_dim / 2]
        emb = torch.cat([freqs, freqs], dim=-1)  # [n, head_dim]
        return x * emb.cos().to(x.dtype) + _rotate_half(x) * emb.sin().to(x.dtype)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor, cache: HeadCache | None) -> torch.Tensor:
        n = x.shape[0]
        q = self.q_proj(x).view(n, self.heads, self.head_dim).transpose(0, 1)  # [heads, n, d]
        k = self.k_proj(x).view(n, self.kv_heads, self.head_dim).transpose(0, 1)  # [kv_heads, n, d]
        v = self.v_proj(x).view(n, self.kv_heads, self.head_dim).transpose(0, 1)
        q, k = self._rope(q, positions), self._rope(k, positions)
        if cache is not None:
            k, v = cache.append(k, v)  # [kv_heads, total, d]
        groups = self.heads // self.kv_heads
        k, v = k.repeat_interleave(groups, dim=0), v.repeat_interleave(groups, dim=0)  # [heads, total, d]
        scores = (q @ k.transpose(1, 2)) / self.head_dim ** 0.5  # [heads, n, total]
        scores = scores.masked_fill(~mask[None], torch.finfo(scores.dtype).min)
        out = torch.softmax(scores.float(), dim=-1).to(v.dtype) @ v  # [heads, n, d]
        return self.o_proj(out.transpose(0, 1).reshape(n, self.heads * self.head_dim))


class _MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class _DecoderLayer(nn.Module):
    """A Llama decoder layer without the input norm (EAGLE's first layer)."""

    def __init__(self, hidden: int, cfg: dict) -> None:
        super().__init__()
        self.self_attn = _Attention(hidden, cfg)
        self.post_attention_layernorm = _RMSNorm(hidden, cfg["rms_norm_eps"])
        self.mlp = _MLP(hidden, cfg["intermediate_size"])

    def forward(self, x: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor, cache: HeadCache | None) -> torch.Tensor:
        x = x + self.self_attn(x, positions, mask, cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class EagleHead(nn.Module):
    """The EAGLE head: ``fc`` over ``[token embedding, feature]`` then one decoder layer.

    Args:
        hidden_size: H of the base model.
        layer_config: :func:`eagle_layer_config` of the base model.
    """

    def __init__(self, hidden_size: int, layer_config: dict) -> None:
        super().__init__()
        self.hidden_size = hidden_size
        self.layer_config = dict(layer_config)
        self.fc = nn.Linear(2 * hidden_size, hidden_size, bias=True)
        self.layers = nn.ModuleList([_DecoderLayer(hidden_size, self.layer_config)])

    def forward(
        self,
        features: torch.Tensor,
        token_embeds: torch.Tensor,
        positions: torch.Tensor,
        cache: HeadCache | None = None,
        mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Predict next features for n (feature, next-token) pairs.

        Args:
            features: ``[n, H]`` features f_j (target's or the head's own predictions).
            token_embeds: ``[n, H]`` target input embeddings of x_{j+1}.
            positions: ``[n]`` positions j (RoPE), int64.
            cache: the head's KV cache (entries appended) or None (no cache: plain causal over the n pairs).
            mask: ``[n, len(cache) + n]`` bool, True = may attend (default: causal over cache + new pairs).

        Returns:
            ``[n, H]`` predicted features f_{j+1}; apply the target's LM head for ``[n, vocab]`` logits.
        """
        n = features.shape[0]
        past = 0 if cache is None else len(cache)
        if mask is None:
            mask = torch.ones(n, past + n, dtype=torch.bool, device=features.device).tril(diagonal=past)
        if mask.shape != (n, past + n):
            raise ValueError(f"mask must be [{n}, {past + n}], got {list(mask.shape)}")
        x = self.fc(torch.cat([token_embeds, features], dim=-1))  # [n, H]
        for layer in self.layers:
            x = layer(x, positions, mask, cache)
        return x
