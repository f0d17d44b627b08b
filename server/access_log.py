"""aiohttp's access log for every app: API calls at INFO, probes at DEBUG.

Heartbeats (every ``node.heartbeat_interval_s`` per node), health and readiness probes and
Prometheus scrapes would otherwise be an INFO line each (~43k lines a day for one node's
heartbeats alone); at DEBUG they show with ``--log-level DEBUG``. The coordinator's registry logs
what matters about them (a node that registers, expires, comes back).
"""

from __future__ import annotations

import logging

from aiohttp import web
from aiohttp.abc import AbstractAccessLogger

PROBE_PATHS = frozenset({"/health", "/ready", "/metrics", "/internal/heartbeat"})


class AccessLogger(AbstractAccessLogger):
    """One line a request (``app_runner`` uses it)."""

    def log(self, request: web.BaseRequest, response: web.StreamResponse, time: float) -> None:
        level = logging.DEBUG if request.path in PROBE_PATHS else logging.INFO
        if self.logger.isEnabledFor(level):
            self.logger.log(
                level,
                '%s "%s %s" %d %.3f s',
                request.remote,
                request.method,
                request.path_qs,
                response.status,
                time,
            )


def app_runner(app: web.Application, **kwargs: object) -> web.AppRunner:
    """The AppRunner of every long-running command, logging through AccessLogger."""
    return web.AppRunner(app, access_log_class=AccessLogger, **kwargs)
