"""Where draftwise keeps its files, and the one way it writes them: :func:`draftwise_home` (the cache root) and
:func:`atomic_write` (a temporary file in the same directory renamed onto the final path, so a reader never
sees a half-written file and a failed write leaves nothing behind). A leaf module."""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable
from pathlib import Path

__all__ = ["atomic_write", "draftwise_home", "write_json_atomic"]


def draftwise_home() -> Path:
    """Return draftwise's cache root: ``$DRAFTWISE_HOME`` if set and non-empty, else ``~/.cache/draftwise``.

    The directory is not created here.
    """
    env = os.environ.get("DRAFTWISE_HOME")
    if env:
        return Path(env).expanduser()
    return Path.home() / ".cache" / "draftwise"


def atomic_write(path: str | Path, write: Callable[[str], None], *, mode: int = 0o644) -> Path:
    """Create ``path`` (and its directory) atomically: ``write(tmp)`` fills a temporary file in the same
    directory, which is then given ``mode`` and renamed onto ``path`` with :func:`os.replace`. If ``write``
    raises, the temporary file is removed and the exception propagates; ``path`` is untouched.

    Returns:
        ``path`` as a :class:`~pathlib.Path`.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".partial")
    os.close(fd)
    try:
        write(tmp)
        os.chmod(tmp, mode)  # mkstemp creates 0600; these are ordinary shared files
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def write_json_atomic(path: str | Path, data, *, indent: int = 2, sort_keys: bool = False) -> Path:
    """:func:`atomic_write` of ``data`` as JSON text."""
    text = json.dumps(data, indent=indent, sort_keys=sort_keys)
    return atomic_write(path, lambda tmp: Path(tmp).write_text(text))
