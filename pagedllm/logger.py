"""The ``pagedllm`` logger: one readable line per event, to stderr."""
from __future__ import annotations

import logging
import sys


def init_logger(level: str | int = "INFO") -> logging.Logger:
    logger = logging.getLogger("pagedllm")
    if not logger.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(levelname)s %(asctime)s pagedllm: %(message)s", "%H:%M:%S"))
        logger.addHandler(handler)
        logger.propagate = False
    logger.setLevel(level.upper() if isinstance(level, str) else level)
    return logger
