"""Stopping a child task without swallowing the caller's own cancellation.

``task.cancel(); await task`` raises :class:`asyncio.CancelledError` in the awaiting task in two
different cases: the child ended cancelled (what we asked for: nothing to report), or the
*awaiting* task was cancelled while it waited (a shutdown, a caller that went away). A bare
``except CancelledError: pass`` cannot tell them apart and swallows the second: the caller's
cancellation is lost and it carries on as if nothing happened. ``Task.cancelling()`` (Python
3.11, see the asyncio docs "Task Cancellation") says which it was; :func:`cancel_and_wait` is
that check, written once.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

__all__ = ["cancel_and_wait", "reap"]


async def reap(task: asyncio.Future[Any], *, log: logging.Logger | None = None,
               what: str = "task") -> None:
    """Wait for ``task`` to end, however it ends; re-raise only our own cancellation.

    A child that ended cancelled is what the caller asked for; one that failed is logged on
    ``log`` (with its traceback: it is a bug somewhere) rather than raised into whoever is
    stopping it.
    """
    try:
        await task
    except asyncio.CancelledError:
        current = asyncio.current_task()
        if current is not None and current.cancelling():
            raise
    except Exception:
        if log is not None:
            log.exception("%s failed while stopping", what)


async def cancel_and_wait(task: asyncio.Future[Any] | None, *,
                          log: logging.Logger | None = None, what: str = "task") -> None:
    """Cancel ``task`` (if it is still running) and :func:`reap` it."""
    if task is None:
        return
    if not task.done():
        task.cancel()
    await reap(task, log=log, what=what)
