"""Reading what the gateway logged, independent of the root logger's state.

caplog reads records through a handler on the root logger; a test earlier in the same worker
that configures logging (the CLI's ``setup_logging``, a server's log config) can leave the root
logger in a state where those records never arrive there, and a check that passed alone fails
in the suite. :func:`logged` attaches its own handler to the named logger instead.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["logged"]


class _Keep(logging.Handler):
    def __init__(self, into: list[logging.LogRecord]) -> None:
        super().__init__(logging.DEBUG)
        self.into = into

    def emit(self, record: logging.LogRecord) -> None:
        self.into.append(record)


@contextmanager
def logged(name: str = "gateway", level: int = logging.INFO) -> Iterator[list[logging.LogRecord]]:
    """The records logged under ``name`` (at ``level`` or above) inside the block."""
    records: list[logging.LogRecord] = []
    handler = _Keep(records)
    logger = logging.getLogger(name)
    saved = logger.level
    logger.addHandler(handler)
    logger.setLevel(level)
    try:
        yield records
    finally:
        logger.removeHandler(handler)
        logger.setLevel(saved)
