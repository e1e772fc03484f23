"""100,000 hostile Media Streams messages through :class:`MediaStreamProtocol`, in one run.

A seeded structured mutation fuzzer (hypothesis' bookkeeping costs ~1 ms per example; this
reaches 100k messages in a few seconds): every case starts from a golden message in
tests/golden/twilio, applies one to three mutations (field deletion, duplicated keys, type
swaps, unicode, huge and non-standard numbers, deep nesting, bad base64, truncation, byte flips,
whole-message junk) and is fed to a protocol that is fresh, streaming or stopped. The promise
checked for every message: it is either parsed into a typed event or rejected with the
documented :class:`~gateway.errors.CallProtocolError` subclass and close code; nothing else
escapes, a rejection leaves the stream's state untouched, and the state machine only ever
moves AWAITING_START -> STREAMING -> STOPPED with a stream SID that never changes.

``TWILIO_FUZZ_CASES`` / ``TWILIO_FUZZ_SEED`` change the run (a longer soak, another seed).
"""

from __future__ import annotations

import base64
import copy
import json
import os
import random
import re
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import pytest

from gateway.errors import (
    CallProtocolError,
    InvalidMessage,
    MessageTooLarge,
    ProtocolViolation,
    UnsupportedData,
)
from gateway.twilio.protocol import (
    _INBOUND,
    Connected,
    Dtmf,
    Mark,
    Media,
    MediaStreamProtocol,
    Start,
    Stop,
    StreamState,
)
from tests.support.paths import GOLDEN as GOLDEN_ROOT

CASES = int(os.environ.get("TWILIO_FUZZ_CASES", "100000"))
SEED = int(os.environ.get("TWILIO_FUZZ_SEED", "20260508"))

GOLDEN = GOLDEN_ROOT / "twilio"
INBOUND = ("connected", "start", "media", "dtmf", "mark", "stop")
GOLDEN_TEXT = {name: (GOLDEN / f"{name}.json").read_text() for name in INBOUND}
GOLDEN_TREE = {name: json.loads(text) for name, text in GOLDEN_TEXT.items()}
SID = GOLDEN_TREE["start"]["start"]["streamSid"]
_SID = re.compile(r"[A-Za-z0-9]{2,64}")

#: The documented outcome of each rejection (gateway/errors.py, RFC 6455 7.4.1).
CLOSE_CODES = {MessageTooLarge: 1009, UnsupportedData: 1003, InvalidMessage: 1007,
               ProtocolViolation: 1008}
EVENTS = (Connected, Start, Media, Dtmf, Mark, Stop)

# Placeholders replaced in the serialized text by tokens json.dumps cannot produce.
_RAW = "\x01raw{}\x01"
RAW_TOKENS = [
    "1e999", "-1e999", "1E+400", "123456789012345678901234567890123456789", "9" * 5000,
    "-0", "0.0000000000000000000000001", "NaN", "Infinity", "-Infinity", "0x10", "01", "1.",
    ".5", "+1", "true1", "nul", '"\\ud800"', '"\\udfff\\ud800"', '"\\u0000"', '"\\uZZZZ"',
    '"\\x41"', '"bad \\q escape"', "[" * 300 + "]" * 300, '{"a":' * 300 + "1" + "}" * 300,
    "[" * 20000 + "]" * 20000, "[1,]", "{,}", '"unterminated',
]
UNICODE = [
    "", " ", "\x00", "\u202e", "\u2028\u2029", "\ufeff", "😀" * 40, "e\u0301" * 30, "\uffff",
    "ℌ𝔢𝔩𝔩𝔬", "中文", "\t\n\r", "MZ" + "😀" * 16, "MZ" + "X" * 10_000, "\\", '"', "</script>",
    "%s%n%x", "{0.__class__}", "${jndi:ldap://x}", "A" * 60_000,
]
VALUES: list[Any] = [
    None, True, False, 0, -1, 1, 8000, 2**31, 2**63, 2**64 + 1, -(2**63) - 1, 1.5, -0.0, 1e308,
    "", "x", [], {}, [1, 2, 3], {"a": 1}, [[[]]], {"event": "media"}, ["inbound"], "8000",
    "audio/x-mulaw", "1", "#", "*", "D", "10", "",
]
EVENT_NAMES = [*INBOUND, "clear", "Media", "MEDIA", "start ", "", "outbound", "mark\x00"]
BASE64 = [
    "", "=", "==", "AAA", "AAAA", "AA==", "A===", "////", "@@@@", "AA AA", "AA\nAA", "QQ==QQ==",
    "\u00e9\u00e9\u00e9\u00e9", base64.b64encode(bytes(range(256))).decode(),
    base64.b64encode(b"\xff" * 48_000).decode(), "A" * 4001, "-_-_",
]


@dataclass
class Tally:
    """What one fuzz run did."""

    cases: int = 0
    setup: int = 0
    accepted: Counter[str] = field(default_factory=Counter)
    rejected: Counter[str] = field(default_factory=Counter)
    reasons: Counter[str] = field(default_factory=Counter)
    escaped: list[tuple[str, str]] = field(default_factory=list)
    broken_invariants: list[str] = field(default_factory=list)


# --- mutations --------------------------------------------------------------------------------


def _paths(tree: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every path to a value in the JSON tree (dict keys and list indexes)."""
    found: list[tuple[Any, ...]] = []
    if isinstance(tree, dict):
        for key, value in tree.items():
            found.append((*prefix, key))
            found.extend(_paths(value, (*prefix, key)))
    elif isinstance(tree, list):
        for index, value in enumerate(tree):
            found.append((*prefix, index))
            found.extend(_paths(value, (*prefix, index)))
    return found


def _parent(tree: Any, path: tuple[Any, ...]) -> Any:
    node = tree
    for part in path[:-1]:
        node = node[part]
    return node


class Mutator:
    """Seeded mutations of golden messages (tree-level, then text-level)."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.raw: list[str] = []
        self.ops: Counter[str] = Counter()

    def value(self) -> Any:
        rng = self.rng
        kind = rng.random()
        if kind < 0.45:
            value = rng.choice(VALUES)
            # Containers are copied: a mutation must never reach the shared pool.
            return copy.deepcopy(value) if isinstance(value, (list, dict)) else value
        if kind < 0.75:
            return rng.choice(UNICODE)
        self.raw.append(rng.choice(RAW_TOKENS))
        return _RAW.format(len(self.raw) - 1)

    def tree_op(self, tree: Any) -> Any:
        rng = self.rng
        if not isinstance(tree, dict):
            return self.value()
        paths = _paths(tree)
        op = rng.choice(("delete", "swap", "swap", "event", "unknown", "payload", "sid",
                         "digit", "format", "replace_root"))
        self.ops[op] += 1
        if op == "delete" and paths:
            path = rng.choice(paths)
            parent = _parent(tree, path)
            del parent[path[-1]]
        elif op == "swap" and paths:
            path = rng.choice(paths)
            _parent(tree, path)[path[-1]] = self.value()
        elif op == "event":
            tree["event"] = rng.choice(EVENT_NAMES)
        elif op == "unknown":
            target = tree
            dicts = [p for p in paths if isinstance(_parent(tree, p)[p[-1]], dict)]
            if dicts and rng.random() < 0.5:
                path = rng.choice(dicts)
                target = _parent(tree, path)[path[-1]]
            target[rng.choice(["extra", "sequenceNumber", "event", "__proto__", "x" * 64])] = (
                self.value())
        elif op == "payload":
            media = tree.setdefault("media", {})
            if isinstance(media, dict):
                media["payload"] = rng.choice(BASE64)
        elif op == "sid":
            start = tree.get("start")
            if isinstance(start, dict) and rng.random() < 0.5:
                key = rng.choice(["callSid", "streamSid"])
                start[key] = rng.choice(["CA" + "0" * 32, "", "CA\n2026 ERROR forged", "CA 1",
                                         "C", "CA" + "f" * 62, "CA" + "f" * 63, "CA/../x", 7])
                return tree
            tree["streamSid"] = rng.choice([SID, "", "MZunknown", SID.lower(), SID + "0",
                                            "MZ" + "0" * 32, SID[:-1], 12, None])
        elif op == "digit":
            dtmf = tree.setdefault("dtmf", {})
            if isinstance(dtmf, dict):
                dtmf["digit"] = rng.choice(["0", "9", "*", "#", "A", "D", "E", "a", "", "11",
                                            "١", "0\x00", 1, None])
        elif op == "format":
            start = tree.setdefault("start", {})
            if isinstance(start, dict):
                fmt = start.setdefault("mediaFormat", {})
                if isinstance(fmt, dict):
                    key = rng.choice(["encoding", "sampleRate", "channels"])
                    fmt[key] = rng.choice(["audio/x-mulaw", "audio/x-alaw", "audio/l16", 8000,
                                           16000, 8000.0, "8000", 1, 2, 0, -1, None])
        else:
            return self.value()
        return tree

    def text_op(self, text: str) -> str:
        rng = self.rng
        op = rng.choice(("truncate", "flip", "insert", "duplicate_key", "delete_span",
                         "whitespace"))
        self.ops[op] += 1
        if not text:
            return rng.choice(["{", "}", " ", "\x00"])
        pos = rng.randrange(len(text) + 1)
        if op == "truncate":
            return text[:pos]
        if op == "flip":
            data = bytearray(text.encode("utf-8", "surrogatepass"))
            for _ in range(rng.randint(1, 4)):
                data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
            # Lone surrogates (undecodable bytes) are strings a str API may still be handed.
            return data.decode("utf-8", "surrogateescape")
        if op == "insert":
            piece = rng.choice(['"', "{", "}", "[", "]", ",", ":", "\\", "\x00", "\ud800",
                                "😀", "\u202e", " ", "null", '"event":"media",', "\n"])
            return text[:pos] + piece + text[pos:]
        if op == "duplicate_key":
            # JSON allows duplicate keys; the last one wins in most parsers (RFC 8259 4).
            brace = text.find("{")
            if brace >= 0:
                key = rng.choice(['"event":"stop"', '"event":"media"', f'"streamSid":"{SID}"',
                                  '"streamSid":"MZother"', '"media":{}', '"start":null'])
                if rng.random() < 0.5:
                    return text[: brace + 1] + key + "," + text[brace + 1 :]
                return text[:-1] + "," + key + text[-1:]
            return text
        if op == "delete_span":
            return text[:pos] + text[pos + rng.randint(1, 40):]
        return text[:pos] + rng.choice([" " * 1000, "\t\r\n", "\u00a0", "\u3000"]) + text[pos:]

    def message(self) -> str | bytes:
        """One hostile message."""
        rng = self.rng
        roll = rng.random()
        if roll < 0.01:
            self.ops["binary"] += 1
            return rng.choice([b"", b"{}", GOLDEN_TEXT["media"].encode(), bytes(range(256))])
        if roll < 0.02:
            self.ops["junk"] += 1
            return rng.choice(["", "null", "[]", "1", '"start"', "{}", "\ufeff{}", " " * 70_000,
                               "x" * 65_537, "é" * 40_000, "\ud800" * 10, "{" * 5000])
        self.raw = []
        tree = json.loads(GOLDEN_TEXT[rng.choice(INBOUND)])
        for _ in range(rng.choice((0, 1, 1, 1, 2, 2, 3))):
            tree = self.tree_op(tree)
        text = json.dumps(tree, ensure_ascii=rng.random() < 0.5,
                          separators=rng.choice([(",", ":"), (", ", ": ")]))
        for index, token in enumerate(self.raw):
            text = text.replace(json.dumps(_RAW.format(index)), token)
        if rng.random() < 0.35:
            for _ in range(rng.randint(1, 2)):
                text = self.text_op(text)
        return text


# --- the harness ------------------------------------------------------------------------------


def _snapshot(protocol: MediaStreamProtocol) -> tuple[StreamState, str | None, str | None]:
    return protocol.state, protocol.stream_sid, protocol.call_sid


def check_one(protocol: MediaStreamProtocol, message: str | bytes, tally: Tally) -> None:
    """Feed one message; record the outcome and any broken promise."""
    before = _snapshot(protocol)
    # The per-frame fast path must only ever accept what the full (pydantic) path accepts.
    fast = (protocol._media(message)
            if isinstance(message, str) and protocol.state is StreamState.STREAMING else None)
    try:
        event = protocol.receive(message)
    except CallProtocolError as exc:
        if fast is not None:
            tally.broken_invariants.append(f"fast path took a rejected message: {exc.reason}")
        kind = type(exc)
        tally.rejected[kind.__name__] += 1
        tally.reasons[exc.reason.split(":")[0][:40]] += 1
        if kind not in CLOSE_CODES or exc.close_code != CLOSE_CODES[kind]:
            tally.broken_invariants.append(f"{kind.__name__} with close code {exc.close_code}")
        if not exc.reason:
            tally.broken_invariants.append(f"{kind.__name__} without a reason")
        if _snapshot(protocol) != before:
            tally.broken_invariants.append(f"rejection changed state: {before} -> "
                                           f"{_snapshot(protocol)} ({exc.reason[:60]})")
        return
    except Exception as exc:  # the promise under test: nothing else may escape
        tally.escaped.append((f"{type(exc).__name__}: {exc}"[:200], repr(message)[:300]))
        return
    tally.accepted[type(event).__name__] += 1
    state, sid, _ = before
    after_state, after_sid, _ = _snapshot(protocol)
    problem = None
    if not isinstance(event, EVENTS):
        problem = f"untyped event {type(event)}"
    elif isinstance(event, Start):
        if state is not StreamState.AWAITING_START or after_state is not StreamState.STREAMING:
            problem = f"start accepted in {state}"
        elif after_sid != event.start.streamSid:
            problem = "start did not set the stream SID"
        elif not all(_SID.fullmatch(sid) for sid in (event.start.streamSid, event.start.callSid)):
            # SIDs key the call table and appear in every log line: plain, short tokens only.
            problem = f"start with SIDs {event.start.streamSid[:40]!r}/{event.start.callSid[:40]!r}"
    elif isinstance(event, Connected):
        if state is not StreamState.AWAITING_START or after_state is not state:
            problem = f"connected accepted in {state}"
    else:
        expected = StreamState.STOPPED if isinstance(event, Stop) else StreamState.STREAMING
        if state is not StreamState.STREAMING or after_state is not expected:
            problem = f"{event.event} accepted in {state} -> {after_state}"
        elif event.streamSid != sid or after_sid != sid:
            problem = f"{event.event} for stream {event.streamSid[:40]!r} accepted on {sid!r}"
        elif isinstance(event, Media) and (
            not isinstance(event.audio, bytes)
            or base64.b64decode(_INBOUND.validate_json(message).media.payload,  # type: ignore[union-attr]
                                validate=True) != event.audio
        ):
            problem = "media audio is not the decode of its payload"
        elif isinstance(event, Media) and event != protocol._parse(message):  # type: ignore[arg-type]
            problem = "the fast path read a media message otherwise than the full path"
        elif isinstance(event, Dtmf) and event.dtmf.digit not in "0123456789*#ABCD":
            problem = f"dtmf digit {event.dtmf.digit!r} accepted"
        elif isinstance(event, Dtmf) and len(event.dtmf.digit) != 1:
            problem = f"dtmf digit {event.dtmf.digit!r} accepted"
    if problem is not None:
        tally.broken_invariants.append(problem)


def fuzz(cases: int, seed: int, factory: type[MediaStreamProtocol] = MediaStreamProtocol,
         ) -> Tally:
    """Run ``cases`` mutated messages through protocols in every state."""
    rng = random.Random(seed)
    mutator = Mutator(rng)
    tally = Tally()
    protocol = factory()
    left_in_session = 0
    while tally.cases < cases:
        if left_in_session <= 0:
            # A new stream: fresh, started (the common case: media flows), or already stopped.
            protocol = factory()
            setup = rng.choices(("fresh", "started", "stopped"), (2, 7, 1))[0]
            if setup != "fresh":
                for name in ("connected", "start") + (("stop",) if setup == "stopped" else ()):
                    protocol.receive(GOLDEN_TEXT[name])
                    tally.setup += 1
            left_in_session = rng.randint(1, 40)
        left_in_session -= 1
        check_one(protocol, mutator.message(), tally)
        tally.cases += 1
    return tally


# --- tests ------------------------------------------------------------------------------------


def test_100k_hostile_messages_are_parsed_or_rejected_with_the_documented_error() -> None:
    t0, c0 = time.perf_counter(), time.process_time()
    tally = fuzz(CASES, SEED)
    elapsed, cpu = time.perf_counter() - t0, time.process_time() - c0
    accepted, rejected = sum(tally.accepted.values()), sum(tally.rejected.values())
    print(f"\ntwilio fuzz: {tally.cases} messages (+{tally.setup} golden set-up) in "
          f"{elapsed:.1f} s = {tally.cases / elapsed:,.0f}/s ({cpu:.1f} CPU s = "
          f"{tally.cases / cpu:,.0f}/CPU s); parsed {accepted} "
          f"({100 * accepted / tally.cases:.1f}%) {dict(tally.accepted)}; rejected {rejected} "
          f"{dict(tally.rejected)}")
    print("top rejection reasons:", tally.reasons.most_common(8))
    assert not tally.escaped, tally.escaped[:5]
    assert not tally.broken_invariants, tally.broken_invariants[:5]
    assert tally.cases == CASES and accepted + rejected == CASES
    # The fuzzer is not degenerate: it reaches every event and every documented rejection,
    # and neither outcome is a rounding error of the other.
    assert set(tally.accepted) == {cls.__name__ for cls in EVENTS}
    assert set(tally.rejected) == {cls.__name__ for cls in CLOSE_CODES}
    assert 0.05 < accepted / CASES < 0.95
    if CASES >= 100_000:
        # 2-core CI budget: the whole file must stay well under a minute. CPU time is the
        # measure: wall time on a shared box says more about the neighbours.
        assert cpu < 30, f"{cpu:.1f} CPU s"


def test_the_same_seed_replays_the_same_run() -> None:
    first, second = fuzz(3000, 7), fuzz(3000, 7)
    assert (first.accepted, first.rejected) == (second.accepted, second.rejected)
    assert fuzz(3000, 8).rejected != first.rejected


class _LeakyProtocol(MediaStreamProtocol):
    """A protocol with two planted bugs: a KeyError escapes, and a rejection after a state
    change. The harness must report both."""

    def receive(self, data: str | bytes):  # type: ignore[no-untyped-def]
        if isinstance(data, str) and '"event": "mark"' in data and "streamSid" not in data:
            raise KeyError("streamSid")
        if isinstance(data, str) and "\u202e" in data and self.state is StreamState.STREAMING:
            self.state = StreamState.STOPPED
            raise InvalidMessage("planted: state changed before rejecting")
        return super().receive(data)


def test_the_harness_catches_escaping_exceptions_and_state_corruption() -> None:
    tally = fuzz(20_000, SEED, factory=_LeakyProtocol)
    assert any(text.startswith("KeyError") for text, _ in tally.escaped)
    assert any("rejection changed state" in p for p in tally.broken_invariants)


@pytest.mark.parametrize("name", INBOUND)
def test_every_golden_message_still_parses(name: str) -> None:
    # The fuzzer's seeds are valid: a stream fed them in order accepts each one.
    protocol = MediaStreamProtocol()
    for earlier in INBOUND[: INBOUND.index(name) + 1]:
        event = protocol.receive(GOLDEN_TEXT[earlier])
    assert type(event).__name__.lower() == name
