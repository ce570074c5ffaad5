"""OpenAI-compatible HTTP server with speculative decoding (``draftwise serve``).

:func:`create_app` builds a FastAPI app from an :class:`~draftwise.builder.EngineBundle` and :func:`serve`
runs it (uvicorn with a graceful shutdown); see ``docs/server.md`` for the API, the metrics and the limits.
The app and its runner are imported on first use, so the commands that only read the server's settings
(``draftwise serve --help``, ``bench``, ``costs``) do not need FastAPI and uvicorn importable.
"""

from __future__ import annotations

import importlib

from draftwise.server.settings import DEFAULT_MAX_TOKENS, ServerSettings

__all__ = ["create_app", "serve", "ServerSettings", "DEFAULT_MAX_TOKENS"]

_LAZY = {"create_app": "draftwise.server.app", "serve": "draftwise.server.serving"}


def __getattr__(name: str):
    """``create_app`` and ``serve``, imported when first asked for (PEP 562)."""
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
