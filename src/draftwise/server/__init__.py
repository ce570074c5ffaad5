"""OpenAI-compatible HTTP server with speculative decoding (``draftwise serve``).

:func:`create_app` builds a FastAPI app from an :class:`~draftwise.builder.EngineBundle` and :func:`serve`
runs it (uvicorn with a graceful shutdown); see ``docs/server.md`` for the API, the metrics and the limits.
"""

from draftwise.server.app import create_app
from draftwise.server.serving import serve
from draftwise.server.settings import DEFAULT_MAX_TOKENS, ServerSettings

__all__ = ["create_app", "serve", "ServerSettings", "DEFAULT_MAX_TOKENS"]
