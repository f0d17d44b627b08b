"""One log format for every process: text for a terminal and journald, or one JSON object a line
(``log.format = "json"``) for log shippers."""

from __future__ import annotations

import logging

from deepinfer.config import LogConfig

_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def init_logging(config: LogConfig | None = None) -> None:
    """Configure the root logger once, from the ``[log]`` section (``--log-level``,
    ``DEEPINFER_LOG_LEVEL``, ``--log-format``, ...)."""
    config = config or LogConfig()
    handler = logging.StreamHandler()
    handler.setFormatter(formatter(config.format))
    logging.basicConfig(level=config.level, handlers=[handler])


def formatter(log_format: str) -> logging.Formatter:
    """``text``: time, level, logger, message; ``json``: the same as keys ``timestamp`` (ISO
    8601, UTC), ``level``, ``logger``, ``message`` (and ``exc_info``), one object a line."""
    if log_format == "json":
        from pythonjsonlogger.json import JsonFormatter

        fields = {"levelname": "level", "name": "logger"}
        return JsonFormatter(
            "{levelname}{name}{message}", style="{", rename_fields=fields, timestamp=True
        )
    return logging.Formatter(_FORMAT, datefmt="%H:%M:%S")
