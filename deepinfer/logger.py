"""One log format for every process."""

from __future__ import annotations

import logging
import os

_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def init_logging(level: str | None = None) -> None:
    """Configure the root logger once; DEEPINFER_LOG_LEVEL overrides the default INFO."""
    level = level or os.environ.get("DEEPINFER_LOG_LEVEL", "INFO")
    logging.basicConfig(level=level.upper(), format=_FORMAT, datefmt="%H:%M:%S")
