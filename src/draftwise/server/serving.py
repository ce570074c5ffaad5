"""Running the app with uvicorn and a graceful shutdown.

uvicorn, on SIGTERM or SIGINT, stops accepting connections, waits up to ``timeout_graceful_shutdown`` for the
open ones, then cancels what is left (a request cancelled there gets a plain-text 500, a stream is cut) and
only then runs the app's lifespan shutdown. :class:`DrainingServer` tells the app as soon as the shutdown
starts (:meth:`ServerState.begin_shutdown`): waiting requests get 503 ``server_closing`` at once, the running
one gets the grace period, and uvicorn's own timeout is set past the grace period, so every client gets a
proper answer (an error event and ``data: [DONE]`` for streams) before the connections close.
"""

from __future__ import annotations

import logging

import uvicorn
from fastapi import FastAPI

__all__ = ["DrainingServer", "make_server", "serve", "SHUTDOWN_MARGIN_S"]

logger = logging.getLogger(__name__)

# Seconds after the grace period for the last answers to be written before uvicorn cancels what is left.
SHUTDOWN_MARGIN_S = 5.0


class DrainingServer(uvicorn.Server):
    """A ``uvicorn.Server`` that starts the app's graceful shutdown the moment it is asked to stop.

    Args:
        config: uvicorn's config; its ``app`` must be (or wrap) an app from :func:`create_app`, passed as
            ``app`` too.
        app: the draftwise app (its ``state.draftwise`` is told about the shutdown).
    """

    def __init__(self, config: uvicorn.Config, app: FastAPI) -> None:
        super().__init__(config)
        self._state = app.state.draftwise

    async def shutdown(self, sockets=None) -> None:
        """Fail waiting requests and start the grace period, then let uvicorn close the connections."""
        logger.info("shutting down: waiting requests get 503; running ones have %.1f s to finish",
                    self._state.settings.shutdown_grace_s)
        self._state.begin_shutdown()
        await super().shutdown(sockets)


def make_server(app: FastAPI, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info") -> DrainingServer:
    """A :class:`DrainingServer` for ``app`` whose uvicorn timeout covers the app's grace period."""
    grace = app.state.draftwise.settings.shutdown_grace_s
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level,
                            timeout_graceful_shutdown=grace + SHUTDOWN_MARGIN_S)
    return DrainingServer(config, app)


def serve(app: FastAPI, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info") -> None:
    """Serve ``app`` until SIGINT/SIGTERM, then shut down gracefully (see the module docstring)."""
    make_server(app, host, port, log_level).run()
