"""Memory sizes as people write them: :func:`parse_bytes` (``"4GiB"`` -> bytes) and :func:`format_bytes`
(bytes -> ``"4.00 GiB"``); the one definition of both (a leaf module), for ``--kv-cache-memory``,
``check --memory-budget`` and every size printed."""

from __future__ import annotations

import re

__all__ = ["format_bytes", "parse_bytes"]

_SIZE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([kmgtp]?)(i?)(b?)\s*$", re.IGNORECASE)
_POWERS = {"": 0, "k": 1, "m": 2, "g": 3, "t": 4, "p": 5}


def parse_bytes(text: str | int) -> int:
    """Parse a size: ``"24GiB"``/``"24G"`` (binary, 2**30), ``"24GB"`` (decimal, 10**9), ``"512MiB"``, ``"1000"``
    or an int. A unit letter without ``B`` is binary, as in ``free -g``. Returns bytes (>= 0).

    Raises:
        ValueError: not a non-negative size, or a positive one under one byte (``"0.5"``: a unit left out).
    """
    if isinstance(text, int) and not isinstance(text, bool):
        if text < 0:
            raise ValueError(f"a memory size must be >= 0, got {text}")
        return text
    match = _SIZE.match(str(text))
    if not match:
        raise ValueError(f"not a memory size: {text!r} (examples: 24GiB, 24GB, 512MiB, 1000000)")
    number, prefix, binary, byte_suffix = match.groups()
    prefix = prefix.lower()
    base = 1024 if binary or (prefix and not byte_suffix) else 1000
    value = float(number) * base ** _POWERS[prefix]
    if 0 < value < 1:
        raise ValueError(f"a memory size of {text!r} is less than one byte (a unit is missing? e.g. 0.5GiB)")
    return int(value)


def format_bytes(num_bytes: int | float | None) -> str:
    """Bytes as a short binary-unit string: ``"1.50 GiB"``, ``"48.0 KiB"``, ``"512 B"``; ``"-"`` for None."""
    if num_bytes is None:
        return "-"
    value = float(num_bytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.{1 if abs(value) >= 10 else 2}f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")
