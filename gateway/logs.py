"""Logging set-up: readable lines or JSON lines, with the call id on every record of a call.

A record logged with ``extra={"data": {...}}`` is structured: JSON lines carry its fields as
fields (the IVR's per-call trace at hang-up, ``msg: "ivr trace"``), text lines append them as
compact JSON.

The call id rides in a :class:`contextvars.ContextVar`. A call's tasks are created inside a
context where it is set (:func:`call_context`), and asyncio copies the context into every task
a task creates, so each log record of the call carries it, from any module, without passing
ids around. Engine worker threads set it around each turn they generate.
"""

from __future__ import annotations

import contextvars
import json
import logging
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Literal, TextIO

#: The call the current task or thread works for ("" outside any call).
call_id_var: contextvars.ContextVar[str] = contextvars.ContextVar("call_id", default="")

#: Libraries that are chatty at INFO.
_NOISY = ("transformers", "httpx", "huggingface_hub", "faster_qwen3_tts", "qwen_tts", "sox")


class CallIdFilter(logging.Filter):
    """Stamps ``record.call_id`` (and ``record.call_tag``, `` [id]`` or empty) on each record."""

    def filter(self, record: logging.LogRecord) -> bool:
        call_id = getattr(record, "call_id", None) or call_id_var.get()
        record.call_id = call_id
        record.call_tag = f" [{call_id}]" if call_id else ""
        return True


class PeerErrorFilter(logging.Filter):
    """Turns uvicorn's traceback for a client's invalid UTF-8 frame into one warning line.

    The client sent bad bytes; the server closed that socket with 1007 and is fine. uvicorn logs
    it with ``logger.exception``, so every such frame (a fuzzer, a broken proxy) would put an
    ERROR and a 6-line traceback in the log and page whoever alerts on errors."""

    PEER_FAULTS = ("Invalid UTF-8 sequence received from client",)

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and str(record.msg).startswith(self.PEER_FAULTS):
            record.exc_info = None
            record.exc_text = None
            record.levelno, record.levelname = logging.WARNING, "WARNING"
            record.msg = f"{record.msg} Closed that socket (1007)."
        return True


class JsonFormatter(logging.Formatter):
    """One JSON object per line: what log shippers (CloudWatch, Loki) index without parsing."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, object] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        call_id = getattr(record, "call_id", "")
        if call_id:
            entry["call_id"] = call_id
        data = getattr(record, "data", None)
        if isinstance(data, dict):
            # A structured record (the IVR's per-call trace): its fields, not a string of them.
            entry.update({k: v for k, v in data.items() if k not in entry})
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry, ensure_ascii=False)


class TextFormatter(logging.Formatter):
    """Readable lines; a structured record's data follows its message as compact JSON."""

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        data = getattr(record, "data", None)
        if isinstance(data, dict):
            line += " " + json.dumps(data, ensure_ascii=False, separators=(",", ":"))
        return line


class StderrHandler(logging.StreamHandler):
    """Writes to whatever ``sys.stderr`` is when a record is emitted, not when it was set up.

    A handler that keeps the stream it was built with writes into a closed file once that
    stream is swapped out and closed (a test runner's capture, an embedding application that
    redirects stderr), and every later record becomes a "Logging error" traceback.
    ``setStream`` still pins it to a given stream."""

    def __init__(self) -> None:
        self._pinned: TextIO | None = None
        logging.Handler.__init__(self)  # not StreamHandler's: it would pin today's stderr

    @property
    def stream(self) -> TextIO:
        return self._pinned if self._pinned is not None else sys.stderr

    @stream.setter
    def stream(self, value: TextIO) -> None:
        self._pinned = value


def setup_logging(level: str, fmt: Literal["text", "json"] = "text") -> None:
    """Configure the root logger once for the process (replacing earlier handlers)."""
    handler = StderrHandler()
    handler.addFilter(CallIdFilter())
    if fmt == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(
            TextFormatter("%(asctime)s %(levelname)-7s %(name)s%(call_tag)s: %(message)s")
        )
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())
    for noisy in _NOISY:
        logging.getLogger(noisy).setLevel(logging.WARNING)
    uvicorn_errors = logging.getLogger("uvicorn.error")
    if not any(isinstance(f, PeerErrorFilter) for f in uvicorn_errors.filters):
        uvicorn_errors.addFilter(PeerErrorFilter())


@contextmanager
def call_context(call_id: str) -> Iterator[None]:
    """Within the block (and in tasks created in it), log records carry ``call_id``."""
    token = call_id_var.set(call_id)
    try:
        yield
    finally:
        call_id_var.reset(token)


def uvicorn_log_config() -> dict[str, object]:
    """uvicorn's loggers through the root handler (same format, JSON included)."""
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "loggers": {
            name: {"handlers": [], "propagate": True}
            for name in ("uvicorn", "uvicorn.error", "uvicorn.access")
        },
    }
