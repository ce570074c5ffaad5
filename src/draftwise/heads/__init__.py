"""Draft heads on the target itself: Medusa heads and the EAGLE feature-level draft head.

- :mod:`.config`: :class:`HeadsConfig` (method, sizes, base-model identity) and the identity check.
- :mod:`.medusa`: :class:`MedusaHeads` (Cai et al. 2024).
- :mod:`.eagle`: :class:`EagleHead` (Li et al. 2024).
- :mod:`.io`: save / load heads as safetensors plus ``heads_config.json``.
"""

from draftwise.heads.config import HeadsConfig, HeadsMismatchError, base_model_identity
from draftwise.heads.eagle import EagleHead
from draftwise.heads.io import load_heads, save_heads
from draftwise.heads.medusa import MedusaHeads

__all__ = ["HeadsConfig", "HeadsMismatchError", "base_model_identity", "EagleHead", "MedusaHeads", "load_heads",
           "save_heads"]
