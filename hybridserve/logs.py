"""Logging of the command line: one level for every package logger.

Each module logs to `logging.getLogger(__name__)`, so the loggers are per package
(`hybridserve.*`, `scheduler.*`, `state_cache.*`, `models.*`, `kernels.*`). Libraries that
embed the engine configure logging themselves; the CLI calls `setup_logging(level)`.
    info:  start-up (model layout, memory plan, policy), calibration, retractions
    debug: evictions from the prefix cache
"""
from __future__ import annotations

import logging

PACKAGES = ("hybridserve", "scheduler", "state_cache", "models", "kernels")
LEVELS = ("critical", "error", "warning", "info", "debug")


def setup_logging(level: str = "info") -> None:
    """Send every package logger's records at `level` and above to stderr, one format."""
    if level not in LEVELS:
        raise ValueError(f"level: {level!r} is not one of {list(LEVELS)}")
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s", "%H:%M:%S"))
    for name in PACKAGES:
        logger = logging.getLogger(name)
        logger.handlers[:] = [handler]
        logger.setLevel(level.upper())
        logger.propagate = False
