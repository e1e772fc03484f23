"""Structured logs: JSON lines, and the call id on every record of a call (tasks and threads)."""

from __future__ import annotations

import asyncio
import io
import json
import logging
import sys
import threading
from collections.abc import Iterator

import pytest

from gateway.logs import call_context, call_id_var, setup_logging


@pytest.fixture
def captured() -> Iterator[io.StringIO]:
    """setup_logging's handler, writing into a buffer; the root logger restored afterwards."""
    root = logging.getLogger()
    saved = (list(root.handlers), root.level)
    stream = io.StringIO()
    setup_logging("info", "json")
    handler = root.handlers[0]
    assert isinstance(handler, logging.StreamHandler)
    handler.setStream(stream)
    try:
        yield stream
    finally:
        root.handlers[:] = saved[0]
        root.setLevel(saved[1])


def _records(stream: io.StringIO) -> list[dict[str, object]]:
    return [json.loads(line) for line in stream.getvalue().splitlines()]


def test_json_lines_carry_level_logger_message_and_exception(captured: io.StringIO) -> None:
    log = logging.getLogger("gateway.test")
    log.info("hello %s", "world")
    try:
        raise ValueError("boom")
    except ValueError:
        log.exception("it failed")
    first, second = _records(captured)
    assert first["level"] == "info" and first["logger"] == "gateway.test"
    assert first["msg"] == "hello world" and "call_id" not in first
    assert str(first["ts"]).endswith("Z")
    assert second["level"] == "error" and "ValueError: boom" in str(second["exc"])


async def test_tasks_started_inside_a_call_inherit_its_id(captured: io.StringIO) -> None:
    log = logging.getLogger("gateway.test")

    async def utterance() -> None:
        await asyncio.sleep(0)
        log.info("frame sent")

    async def call(call_id: str) -> None:
        call_id_var.set(call_id)  # what the Twilio session does on 'start'
        log.info("started")
        await asyncio.create_task(utterance())

    await asyncio.gather(call("CA1"), call("CA2"))
    log.info("outside")
    by_message: dict[str, list[object]] = {}
    for record in _records(captured):
        by_message.setdefault(str(record["msg"]), []).append(record.get("call_id"))
    assert sorted(by_message["started"], key=str) == ["CA1", "CA2"]
    assert sorted(by_message["frame sent"], key=str) == ["CA1", "CA2"]
    assert by_message["outside"] == [None]


def test_a_worker_thread_tags_the_turn_it_generates(captured: io.StringIO) -> None:
    log = logging.getLogger("gateway.tts.test")

    def worker() -> None:
        with call_context("sip-abc"):
            log.warning("generation failed")
        log.warning("idle")

    thread = threading.Thread(target=worker)
    thread.start()
    thread.join()
    failed, idle = _records(captured)
    assert failed["call_id"] == "sip-abc"
    assert "call_id" not in idle


def test_text_format_tags_call_lines(capsys: pytest.CaptureFixture[str]) -> None:
    root = logging.getLogger()
    saved = (list(root.handlers), root.level)
    try:
        setup_logging("info", "text")
        handler = root.handlers[0]
        assert isinstance(handler, logging.StreamHandler)
        stream = io.StringIO()
        handler.setStream(stream)
        with call_context("CA9"):
            logging.getLogger("gateway.x").info("in call")
        logging.getLogger("gateway.x").info("not in call")
        lines = stream.getvalue().splitlines()
        assert lines[0].endswith("gateway.x [CA9]: in call")
        assert lines[1].endswith("gateway.x: not in call")
    finally:
        root.handlers[:] = saved[0]
        root.setLevel(saved[1])


def test_the_handler_follows_stderr_when_it_is_swapped_and_closed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Logging set up while stderr was a stream that is later closed (a CLI runner's capture)
    keeps working: records go to the current stderr, and no "Logging error" is raised."""
    root = logging.getLogger()
    saved = (list(root.handlers), root.level)
    first, second = io.StringIO(), io.StringIO()
    try:
        monkeypatch.setattr(sys, "stderr", first)
        setup_logging("info", "text")
        logging.getLogger("gateway.test").info("into the first")
        first_text = first.getvalue()
        first.close()
        monkeypatch.setattr(sys, "stderr", second)
        logging.getLogger("gateway.test").info("into the second")
    finally:
        root.handlers[:] = saved[0]
        root.setLevel(saved[1])
    assert "into the first" in first_text
    assert "into the second" in second.getvalue()
    assert "Logging error" not in second.getvalue()


def test_a_clients_invalid_utf8_is_one_warning_line_not_an_error_traceback(
    captured: io.StringIO, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What uvicorn logs (logger.exception) when a client sends an invalid UTF-8 text frame."""
    # As `gateway serve` runs uvicorn (uvicorn_log_config): its records reach the root handler. An
    # in-process server started by another test may have installed uvicorn's own config.
    for name in ("uvicorn", "uvicorn.error"):
        monkeypatch.setattr(logging.getLogger(name), "propagate", True)
        monkeypatch.setattr(logging.getLogger(name), "handlers", [])
    try:
        b"\xff".decode()
    except UnicodeDecodeError:
        logging.getLogger("uvicorn.error").exception(
            "Invalid UTF-8 sequence received from client."
        )
        logging.getLogger("uvicorn.error").exception("Something else broke.")
    peer, other = _records(captured)
    assert peer["level"] == "warning" and "exc" not in peer
    assert "Closed that socket (1007)" in str(peer["msg"])
    assert other["level"] == "error" and "UnicodeDecodeError" in str(other["exc"])


def test_a_structured_record_carries_its_fields_in_json_and_after_the_text(
    captured: io.StringIO,
) -> None:
    log = logging.getLogger("gateway.test")
    with call_context("CA1"):
        log.info("ivr trace", extra={"data": {"trace": {"path": ["a", "b"], "msg": "kept"},
                                              "msg": "not overwritten"}})
    (record,) = _records(captured)
    assert record["msg"] == "ivr trace" and record["call_id"] == "CA1"
    assert record["trace"] == {"path": ["a", "b"], "msg": "kept"}
    root = logging.getLogger()
    setup_logging("info", "text")
    text = io.StringIO()
    root.handlers[0].setStream(text)  # type: ignore[attr-defined]
    log.info("ivr trace", extra={"data": {"trace": {"path": ["a"]}}})
    assert text.getvalue().rstrip().endswith('gateway.test: ivr trace {"trace":{"path":["a"]}}')
