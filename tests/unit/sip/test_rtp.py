"""RTP packets, RFC 4733 DTMF, the sender, and RFC 3550 receive statistics (gateway.sip.rtp)."""

from __future__ import annotations

import itertools
import random
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gateway.audio.g711 import alaw_decode, ulaw_decode
from gateway.errors import GatewayError
from gateway.sip.rtp import (
    DIGIT_TO_EVENT,
    EVENT_TO_DIGIT,
    MAX_DROPOUT,
    SEQ_MOD,
    TS_MOD,
    DtmfReceiver,
    DtmfSender,
    RtpError,
    RtpPacket,
    RtpPayloadDecoder,
    RtpReceiverStats,
    RtpSender,
    TelephoneEvent,
    seq_add,
    seq_diff,
    seq_gt,
    ts_add,
    ts_diff,
    ts_gt,
)

# --- golden packets, assembled octet by octet from the RFC 3550 section 5.1 layout ----------------
#
#  V=2 P X  CC | M PT | sequence | timestamp | SSRC | CSRC... | ext profile, len, data | payload
#  | padding with its count in the last octet

PCMU_PLAIN = bytes.fromhex("80 00 1234 0001e240 deadbeef") + b"\xff" * 160
"""V=2, PT 0 (PCMU), seq 4660, ts 123456, 160 bytes of mu-law silence."""
EVENT_MARKER = bytes.fromhex("80 e5 ffff ffffffff 01020304  050a00a0")
"""M=1, PT 101, seq 65535, ts 2^32-1; event 5, volume 10, duration 160."""
WITH_CSRC = bytes.fromhex("82 08 0001 00000000 11111111 22222222 33333333  d5d5d5d5")
"""CC=2, PT 8 (PCMA)."""
WITH_EXTENSION = bytes.fromhex("90 00 0002 000000a0 0a0b0c0d bede 0001 10ff0000") + b"\xff" * 8
"""X=1: RFC 8285 one-byte-header profile 0xBEDE, 1 word of extension data."""
WITH_PADDING = bytes.fromhex("a0 80 0100 12345678 cafebabe  ffffffffff  000003")
"""P=1, M=1, 5 payload bytes, 3 padding bytes."""
EVERYTHING = bytes.fromhex(
    "b1 e5 8000 80000000 00000001 00000002 1000 0002 0102030405060708  0b8a0320  00000004"
)
"""P, X, CC=1, M, PT 101; CSRC 2; 2 extension words; payload '#' with E; 4 padding bytes."""

GOLDEN = [
    (
        PCMU_PLAIN,
        RtpPacket(0, 0x1234, 123456, 0xDEADBEEF, b"\xff" * 160),
    ),
    (
        EVENT_MARKER,
        RtpPacket(101, 65535, 2**32 - 1, 0x01020304, bytes.fromhex("050a00a0"), marker=True),
    ),
    (
        WITH_CSRC,
        RtpPacket(8, 1, 0, 0x11111111, b"\xd5" * 4, csrc=[0x22222222, 0x33333333]),
    ),
    (
        WITH_EXTENSION,
        RtpPacket(
            0, 2, 160, 0x0A0B0C0D, b"\xff" * 8, extension=(0xBEDE, bytes.fromhex("10ff0000"))
        ),
    ),
    (
        WITH_PADDING,
        RtpPacket(0, 0x100, 0x12345678, 0xCAFEBABE, b"\xff" * 5, marker=True, padding=3),
    ),
    (
        EVERYTHING,
        RtpPacket(
            101,
            0x8000,
            0x80000000,
            1,
            bytes.fromhex("0b8a0320"),
            marker=True,
            csrc=[2],
            extension=(0x1000, bytes.fromhex("0102030405060708")),
            padding=4,
        ),
    ),
]


@pytest.mark.parametrize(("data", "expected"), GOLDEN)
def test_golden_packets_parse_and_round_trip(data: bytes, expected: RtpPacket) -> None:
    packet = RtpPacket.parse(data)
    assert packet == expected
    assert packet.serialize() == data
    assert bytes(packet) == data
    assert expected.serialize() == data


def test_parse_accepts_buffers() -> None:
    assert RtpPacket.parse(bytearray(WITH_CSRC)) == RtpPacket.parse(memoryview(WITH_CSRC))
    assert type(RtpPacket.parse(bytearray(WITH_EXTENSION)).payload) is bytes


def test_golden_event_payload() -> None:
    payload = RtpPacket.parse(EVERYTHING).payload
    assert TelephoneEvent.parse(payload) == TelephoneEvent(11, True, 10, 800)
    assert EVENT_TO_DIGIT[11] == "#"


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b"", "too short: 0 bytes"),
        (PCMU_PLAIN[:11], "too short: 11 bytes"),
        (b"\x40" + PCMU_PLAIN[1:], "version 1, expected 2"),
        (b"\x00" + PCMU_PLAIN[1:12], "version 0"),
        (b"\xc0" + PCMU_PLAIN[1:], "version 3"),
        (b"\x83" + PCMU_PLAIN[1:20], "CSRC count 3 needs 24 header bytes, got 20"),
        (WITH_EXTENSION[:14], "extension bit set but only 2 bytes"),
        (WITH_EXTENSION[:18], "extension of 1 words needs 4 bytes, got 2"),
        (WITH_PADDING[:-1] + b"\x00", "padding count .* is 0"),
        (WITH_PADDING[:-1] + b"\x09", "padding count 9 exceeds the 8 bytes"),
        (bytes.fromhex("a0000000000000000000000040"), "padding count 64 exceeds the 1 bytes"),
    ],
)
def test_parse_errors_are_precise(data: bytes, message: str) -> None:
    with pytest.raises(RtpError, match=message):
        RtpPacket.parse(data)


def test_padding_only_packet_is_accepted() -> None:
    packet = RtpPacket.parse(bytes.fromhex("a0000001000000000000000100000004"))
    assert packet.payload == b""
    assert packet.padding == 4


def test_rtp_error_is_a_gateway_error() -> None:
    assert issubclass(RtpError, GatewayError)


@pytest.mark.parametrize(
    ("packet", "message"),
    [
        (RtpPacket(128, 0, 0, 0), "payload type 128"),
        (RtpPacket(-1, 0, 0, 0), "payload type -1"),
        (RtpPacket(0, 65536, 0, 0), "sequence 65536"),
        (RtpPacket(0, 0, 2**32, 0), "timestamp 4294967296"),
        (RtpPacket(0, 0, 0, -1), "ssrc -1"),
        (RtpPacket(0, 0, 0, 0, csrc=[2**32]), "CSRC identifiers"),
        (RtpPacket(0, 0, 0, 0, csrc=list(range(16))), "16 CSRC identifiers"),
        (RtpPacket(0, 0, 0, 0, extension=(1, b"abc")), "multiple of 4"),
        (RtpPacket(0, 0, 0, 0, extension=(0x10000, b"")), "profile 65536"),
        (RtpPacket(0, 0, 0, 0, padding=256), "padding 256"),
        (RtpPacket(0, 0, 0, 0, padding=-1), "padding -1"),
    ],
)
def test_serialize_rejects_out_of_range_fields(packet: RtpPacket, message: str) -> None:
    with pytest.raises(RtpError, match=message):
        packet.serialize()


# --- wrap-around helpers ------------------------------------------------------------------------


def test_sequence_helpers_wrap() -> None:
    assert seq_add(65535, 1) == 0
    assert seq_add(0, -1) == 65535
    assert seq_add(65000, 1000) == 464
    assert seq_diff(0, 65535) == 1
    assert seq_diff(65535, 0) == -1
    assert seq_diff(100, 50) == 50
    assert seq_diff(5, 5) == 0
    assert seq_diff(32768, 0) == -32768  # exactly half way: ambiguous, reads as "older"
    assert seq_gt(0, 65535)
    assert not seq_gt(65535, 0)
    assert not seq_gt(7, 7)
    assert not seq_gt(32768, 0)
    assert not seq_gt(0, 32768)


def test_timestamp_helpers_wrap() -> None:
    assert ts_add(2**32 - 1, 1) == 0
    assert ts_add(0, -160) == 2**32 - 160
    assert ts_diff(60, 2**32 - 100) == 160
    assert ts_diff(2**32 - 100, 60) == -160
    assert ts_gt(60, 2**32 - 100)
    assert not ts_gt(2**32 - 100, 60)
    assert not ts_gt(2**31, 0)
    assert not ts_gt(0, 2**31)


@given(st.integers(0, SEQ_MOD - 1), st.integers(0, SEQ_MOD - 1))
def test_seq_diff_inverts_seq_add(a: int, b: int) -> None:
    d = seq_diff(a, b)
    assert -SEQ_MOD // 2 <= d < SEQ_MOD // 2
    assert seq_add(b, d) == a
    assert seq_gt(a, b) == (d > 0)


@given(st.integers(0, TS_MOD - 1), st.integers(0, TS_MOD - 1))
def test_ts_diff_inverts_ts_add(a: int, b: int) -> None:
    d = ts_diff(a, b)
    assert -TS_MOD // 2 <= d < TS_MOD // 2
    assert ts_add(b, d) == a
    assert ts_gt(a, b) == (d > 0)


# --- fuzzing and round trips ---------------------------------------------------------------------


def _parse_or_reject(data: bytes) -> None:
    try:
        packet = RtpPacket.parse(data)
    except RtpError:
        return
    # Whatever parses serializes, and re-parses to the same fields (padding contents aside).
    assert RtpPacket.parse(packet.serialize()) == packet


@settings(max_examples=2000, deadline=None)
@given(st.binary(max_size=120))
def test_any_bytes_parse_or_raise_rtp_error(data: bytes) -> None:
    _parse_or_reject(data)


@settings(max_examples=1000, deadline=None)
@given(st.integers(0x80, 0xBF), st.binary(max_size=120))
def test_any_version_2_bytes_parse_or_raise_rtp_error(first: int, rest: bytes) -> None:
    _parse_or_reject(bytes((first,)) + rest)


u32 = st.integers(0, TS_MOD - 1)
packets = st.builds(
    RtpPacket,
    payload_type=st.integers(0, 127),
    sequence=st.integers(0, SEQ_MOD - 1),
    timestamp=u32,
    ssrc=u32,
    payload=st.binary(max_size=200),
    marker=st.booleans(),
    csrc=st.lists(u32, max_size=15),
    extension=st.none()
    | st.tuples(st.integers(0, 0xFFFF), st.binary(max_size=40).map(lambda b: b[: len(b) // 4 * 4])),
    padding=st.integers(0, 255),
)


@settings(max_examples=500, deadline=None)
@given(packets)
def test_valid_packets_round_trip(packet: RtpPacket) -> None:
    data = packet.serialize()
    assert RtpPacket.parse(data) == packet
    assert RtpPacket.parse(data).serialize() == data


# --- RFC 4733 telephone events -------------------------------------------------------------------


def test_event_to_digit_table() -> None:
    assert [EVENT_TO_DIGIT[n] for n in range(16)] == list("0123456789*#ABCD")
    assert all(DIGIT_TO_EVENT[d] == n for n, d in EVENT_TO_DIGIT.items())


@given(st.integers(0, 255), st.booleans(), st.integers(0, 63), st.integers(0, 0xFFFF))
def test_telephone_event_round_trips(event: int, end: bool, volume: int, duration: int) -> None:
    te = TelephoneEvent(event, end, volume, duration)
    data = te.serialize()
    assert len(data) == 4
    assert TelephoneEvent.parse(data) == te
    assert bytes(TelephoneEvent.parse(data)) == data


def test_telephone_event_reserved_bit_is_ignored() -> None:
    assert TelephoneEvent.parse(bytes.fromhex("0bca0320")) == TelephoneEvent(11, True, 10, 800)
    assert TelephoneEvent(11, True, 10, 800).serialize() == bytes.fromhex("0b8a0320")


@pytest.mark.parametrize("size", [0, 1, 3, 5, 8])
def test_telephone_event_payload_length_errors(size: int) -> None:
    with pytest.raises(RtpError, match=f"must be 4 bytes .*got {size}"):
        TelephoneEvent.parse(bytes(size))


@pytest.mark.parametrize(
    ("event", "message"),
    [
        (TelephoneEvent(256, False, 0, 0), "code 256"),
        (TelephoneEvent(1, False, 64, 0), "volume 64"),
        (TelephoneEvent(1, False, 0, 65536), "duration 65536"),
    ],
)
def test_telephone_event_serialize_errors(event: TelephoneEvent, message: str) -> None:
    with pytest.raises(RtpError, match=message):
        event.serialize()


class EventStream:
    """Builds RFC 4733 packets as a sender would: consecutive sequence numbers, PT 101."""

    def __init__(self, ssrc: int = 0x5555, sequence: int = 1000) -> None:
        self.ssrc = ssrc
        self.sequence = sequence

    def packet(
        self, digit: str | int, timestamp: int, duration: int, end: bool = False
    ) -> RtpPacket:
        code = DIGIT_TO_EVENT[digit] if isinstance(digit, str) else digit
        payload = TelephoneEvent(code, end, 10, duration).serialize()
        packet = RtpPacket(101, self.sequence, timestamp, self.ssrc, payload, marker=False)
        self.sequence = seq_add(self.sequence, 1)
        return packet

    def key_press(
        self, digit: str | int, timestamp: int, updates: int = 4, ends: int = 3
    ) -> list[RtpPacket]:
        """Start (marker), ``updates`` updates every 20 ms, ``ends`` identical end packets."""
        out = [self.packet(digit, timestamp, 160)]
        out[0].marker = True
        out += [self.packet(digit, timestamp, 160 * (i + 2)) for i in range(updates)]
        out += [self.packet(digit, timestamp, 160 * (updates + 2), end=True) for _ in range(ends)]
        return out


def feed_all(receiver: DtmfReceiver, packets: list[RtpPacket]) -> list[str | None]:
    return [receiver.feed(p) for p in packets]


def test_key_press_reports_one_digit_at_the_first_packet() -> None:
    receiver = DtmfReceiver()
    results = feed_all(receiver, EventStream().key_press("5", 8000))
    assert results == ["5"] + [None] * 7
    assert receiver.events == 1
    assert receiver.last_duration == 960
    assert receiver.last_event == TelephoneEvent(5, True, 10, 960)


def test_lost_start_is_reported_once_from_the_end_packets() -> None:
    receiver = DtmfReceiver()
    stream = EventStream()
    ends = [stream.packet("#", 8000, 800, end=True) for _ in range(3)]
    assert feed_all(receiver, ends) == ["#", None, None]
    assert receiver.events == 1
    assert receiver.last_duration == 800


def test_same_digit_twice_is_reported_twice() -> None:
    receiver = DtmfReceiver()
    stream = EventStream()
    packets = stream.key_press("1", 8000) + stream.key_press("1", 8000 + 2400)
    assert [d for d in feed_all(receiver, packets) if d] == ["1", "1"]
    assert receiver.events == 2


def test_two_quick_digits() -> None:
    receiver = DtmfReceiver()
    stream = EventStream()
    # 40 ms tones 20 ms apart, single end packets: digit boundaries show only in the timestamp.
    packets = stream.key_press("1", 0, updates=1, ends=1) + stream.key_press(
        "2", 480, updates=1, ends=1
    )
    assert feed_all(receiver, packets) == ["1", None, None, "2", None, None]


def test_old_retransmission_after_a_new_event_is_ignored() -> None:
    receiver = DtmfReceiver()
    stream = EventStream()
    first = stream.key_press("1", 8000)
    second = stream.key_press("2", 16000)
    late_end_of_first = first[-1]
    late_update_of_first = first[2]
    results = feed_all(
        receiver, [*first[:-1], second[0], late_end_of_first, late_update_of_first, *second[1:]]
    )
    assert [d for d in results if d] == ["1", "2"]
    assert receiver.events == 2
    assert receiver.last_event is not None and receiver.last_event.event == 2


def test_reordered_within_an_event_keeps_the_longest_duration() -> None:
    receiver = DtmfReceiver()
    packets = EventStream().key_press("7", 8000, updates=3, ends=1)
    packets[1], packets[2] = packets[2], packets[1]
    feed_all(receiver, packets)
    assert receiver.last_duration == 800


def test_event_timestamps_wrap() -> None:
    receiver = DtmfReceiver()
    stream = EventStream()
    packets = stream.key_press("3", TS_MOD - 400) + stream.key_press("4", 2000)
    assert [d for d in feed_all(receiver, packets) if d] == ["3", "4"]


def test_long_event_segments_are_one_key_press() -> None:
    receiver = DtmfReceiver()
    stream = EventStream()
    start = TS_MOD - 1000  # segments wrap the timestamp too
    packets = [
        stream.packet("9", start, 160),
        stream.packet("9", start, 65535),  # RFC 4733 2.5.1.3: maximum duration, no E bit
        stream.packet("9", ts_add(start, 65535), 160),
        stream.packet("9", ts_add(start, 65535), 480, end=True),
    ]
    assert feed_all(receiver, packets) == ["9", None, None, None]
    assert receiver.events == 1
    assert receiver.last_duration == 480


def test_new_ssrc_starts_afresh() -> None:
    receiver = DtmfReceiver()
    assert receiver.feed(EventStream(ssrc=1).packet("1", 90000, 160)) == "1"
    assert receiver.feed(EventStream(ssrc=2).packet("2", 100, 160)) == "2"


def test_non_dtmf_events_count_but_report_no_digit() -> None:
    receiver = DtmfReceiver()
    assert receiver.feed(EventStream().packet(16, 100, 160)) is None  # flash
    assert receiver.events == 1


def test_payload_type_filter_and_bad_payloads() -> None:
    receiver = DtmfReceiver(payload_type=101)
    assert receiver.feed(RtpPacket(0, 1, 0, 1, b"\xff" * 160)) is None
    with pytest.raises(RtpError, match="must be 4 bytes"):
        receiver.feed(RtpPacket(101, 2, 0, 1, b"\x01\x02"))
    assert receiver.events == 0
    assert receiver.feed(EventStream(ssrc=1).packet("A", 160, 160)) == "A"


# --- sender --------------------------------------------------------------------------------------


def test_sender_wraps_sequence_and_timestamp() -> None:
    sender = RtpSender(0, ssrc=0x1234, initial_sequence=65534, initial_timestamp=TS_MOD - 200)
    parsed = [RtpPacket.parse(sender.packet(b"\xff" * 160)) for _ in range(3)]
    assert [p.sequence for p in parsed] == [65534, 65535, 0]
    assert [p.timestamp for p in parsed] == [TS_MOD - 200, TS_MOD - 40, 120]
    assert all(p.ssrc == 0x1234 and p.payload_type == 0 for p in parsed)
    assert parsed[0].payload == b"\xff" * 160
    assert (sender.sequence, sender.timestamp) == (1, 280)
    assert (sender.packets_sent, sender.octets_sent) == (3, 480)


def test_sender_marker_bit_on_talkspurts_and_skip() -> None:
    sender = RtpSender(8, ssrc=7, initial_sequence=10, initial_timestamp=1000, rng=None)

    def send() -> RtpPacket:
        return RtpPacket.parse(sender.packet(b"\xd5" * 160))

    first, second = send(), send()
    assert first.marker and not second.marker
    sender.start_talkspurt()
    third, fourth = send(), send()
    assert third.marker and not fourth.marker
    assert third.sequence == 12 and third.timestamp == 1320
    sender.skip(50)  # one second of suppressed silence
    fifth = send()
    assert fifth.marker
    assert fifth.sequence == 14  # sequence numbers count packets sent
    assert fifth.timestamp == 1000 + 160 * 4 + 160 * 50
    sender.skip(0)
    assert not send().marker


def test_sender_packs_an_event_on_its_own_terms_in_the_same_stream() -> None:
    """An RFC 4733 event rides in the stream: its payload type, its start timestamp and its own
    marker, one sequence number per packet, while the sampling clock advances under it; the
    pending talkspurt marker waits for the next packet without its own."""
    sender = RtpSender(0, ssrc=9, initial_sequence=65535, initial_timestamp=TS_MOD - 160)
    event = [RtpPacket.parse(sender.event_packet(b"\x05\x0a\x00\xa0", 101, TS_MOD - 160,
                                                 n == 0))
             for n in range(3)]
    audio = RtpPacket.parse(sender.packet(b"\xff" * 160))
    assert [p.payload_type for p in event] == [101] * 3 and audio.payload_type == 0
    assert [p.marker for p in event] == [True, False, False]
    assert {p.timestamp for p in event} == {TS_MOD - 160}
    assert [p.sequence for p in (*event, audio)] == [65535, 0, 1, 2]
    assert audio.marker  # the stream's first audio packet still opens its talkspurt
    assert audio.timestamp == TS_MOD - 160 + 3 * 160 - TS_MOD  # the clock ran under the event
    assert (sender.packets_sent, sender.octets_sent) == (4, 3 * 4 + 160)
    with pytest.raises(RtpError, match="payload type 128"):
        sender.event_packet(b"", 128, 0, True)
    assert sender.sequence == 3  # the refused packet took no sequence number


def test_sender_random_initial_values() -> None:
    a = RtpSender(0, rng=random.Random(42))
    b = RtpSender(0, rng=random.Random(42))
    assert (a.ssrc, a.sequence, a.timestamp) == (b.ssrc, b.sequence, b.timestamp)
    c = RtpSender(0)
    assert 0 <= c.ssrc < 2**32 and 0 <= c.sequence < 2**16 and 0 <= c.timestamp < 2**32
    assert len({RtpSender(0).ssrc for _ in range(8)}) > 1


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"payload_type": 128}, "payload type 128"),
        ({"payload_type": 0, "ssrc": 2**32}, "ssrc"),
        ({"payload_type": 0, "initial_sequence": 65536}, "initial_sequence"),
        ({"payload_type": 0, "initial_timestamp": -1}, "initial_timestamp"),
        ({"payload_type": 0, "samples_per_frame": 0}, "samples_per_frame"),
    ],
)
def test_sender_rejects_bad_arguments(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(RtpError, match=message):
        RtpSender(**kwargs)


def test_sender_rejects_negative_skip() -> None:
    with pytest.raises(RtpError):
        RtpSender(0).skip(-1)


@settings(max_examples=200, deadline=None)
@given(st.integers(0, SEQ_MOD - 1), u32, st.integers(1, 2000), st.integers(1, 40))
def test_sender_sequence_property(seq: int, ts: int, spf: int, count: int) -> None:
    sender = RtpSender(
        96, ssrc=1, initial_sequence=seq, initial_timestamp=ts, samples_per_frame=spf
    )
    parsed = [RtpPacket.parse(sender.packet(b"x")) for _ in range(count)]
    assert [p.sequence for p in parsed] == [seq_add(seq, i) for i in range(count)]
    assert [p.timestamp for p in parsed] == [ts_add(ts, i * spf) for i in range(count)]


# --- receive statistics --------------------------------------------------------------------------


def rtp(seq: int, ts: int = 0, ssrc: int = 0xABC) -> RtpPacket:
    return RtpPacket(0, seq, ts, ssrc, b"\xff" * 160)


def test_loss_counting_across_sequence_wrap() -> None:
    stats = RtpReceiverStats(min_sequential=1)
    sequences = [*range(65530, 65536), *range(10)]
    dropped = {65533, 2, 3}
    for i, seq in enumerate(sequences):
        if seq not in dropped:
            assert stats.update(rtp(seq, 160 * i), 0.02 * i)
    assert stats.cycles == SEQ_MOD
    assert stats.extended_highest_sequence == SEQ_MOD + 9
    assert stats.expected == 16
    assert stats.received == 13
    assert stats.lost == 3
    # A late packet is received, not lost (RFC 3550 6.4.1); a duplicate is counted separately.
    assert stats.update(rtp(65533), 0.5)
    assert stats.lost == 2
    assert not stats.update(rtp(5), 0.52)
    assert not stats.update(rtp(9), 0.54)
    assert stats.duplicates == 2
    assert stats.lost == 0  # duplicates count as received: loss can go to and below zero


def test_probation_discards_until_sequential() -> None:
    stats = RtpReceiverStats()  # MIN_SEQUENTIAL = 2
    assert not stats.update(rtp(100), 0.0)
    assert not stats.valid and stats.expected == 0
    assert not stats.update(rtp(500), 0.02)  # out of sequence: probation restarts
    assert stats.update(rtp(501), 0.04)
    assert stats.valid
    assert (stats.base_seq, stats.received, stats.expected, stats.lost) == (501, 1, 1, 0)


def test_probation_across_wrap() -> None:
    stats = RtpReceiverStats(min_sequential=3)
    assert [stats.update(rtp(s), 0.0) for s in (65534, 65535, 0, 1)] == [
        False,
        False,
        True,
        True,
    ]
    assert stats.expected == 2 and stats.lost == 0


def test_large_jump_is_a_restart_only_when_confirmed() -> None:
    stats = RtpReceiverStats(min_sequential=1)
    for seq in range(10):
        stats.update(rtp(seq), 0.0)
    assert not stats.update(rtp(10 + MAX_DROPOUT), 0.0)  # a stray packet
    assert stats.update(rtp(10), 0.0)
    assert stats.received == 11
    assert not stats.update(rtp(40000), 0.0)
    assert stats.update(rtp(40001), 0.0)  # two in sequence: the sender restarted
    assert (stats.base_seq, stats.received, stats.expected) == (40001, 1, 1)


def test_far_backwards_packet_is_discarded() -> None:
    stats = RtpReceiverStats(min_sequential=1)
    for seq in range(1000, 1010):
        stats.update(rtp(seq), 0.0)
    assert not stats.update(rtp(800), 0.0)  # more than MAX_MISORDER behind
    assert stats.received == 10


def test_new_ssrc_resets() -> None:
    stats = RtpReceiverStats(min_sequential=1)
    for seq in range(5):
        stats.update(rtp(seq), 0.0)
    assert stats.update(rtp(7000, ssrc=9), 0.1)
    assert (stats.ssrc, stats.received, stats.expected) == (9, 1, 1)


def _a8_jitter(arrivals: list[float], timestamps: list[int], rate: int) -> float:
    """RFC 3550 A.8 written out independently: J += (|D(i-1,i)| - J) / 16."""
    jitter = 0.0
    for i in range(1, len(arrivals)):
        d = (arrivals[i] - arrivals[i - 1]) * rate - (timestamps[i] - timestamps[i - 1])
        jitter += (abs(d) - jitter) / 16
    return jitter


def test_jitter_is_zero_for_constant_spacing() -> None:
    stats = RtpReceiverStats(min_sequential=1)
    start = TS_MOD - 160 * 20  # the timestamp wraps half way through
    for i in range(50):
        stats.update(rtp(i, ts_add(start, 160 * i)), 100.0 + 0.02 * i)
    assert stats.jitter == pytest.approx(0.0, abs=1e-6)


def test_jitter_alternating_5_ms() -> None:
    stats = RtpReceiverStats(min_sequential=1)
    n = 60
    timestamps = [160 * i for i in range(n)]
    arrivals = [0.02 * i + (0.005 if i % 2 else -0.005) for i in range(n)]
    for i in range(n):
        stats.update(rtp(i, timestamps[i]), arrivals[i])
    expected = _a8_jitter(arrivals, timestamps, 8000)
    # Every |D| is 10 ms = 80 timestamp units, so J_n = 80 (1 - (15/16)^(n-1)).
    assert expected == pytest.approx(80 * (1 - (15 / 16) ** (n - 1)))
    assert stats.jitter == pytest.approx(expected)
    assert stats.jitter_ms == pytest.approx(expected / 8)
    assert 60 < stats.jitter < 80


def test_jitter_skips_event_packets_and_duplicates() -> None:
    stats = RtpReceiverStats(min_sequential=1)
    for i in range(10):
        stats.update(rtp(i, 160 * i), 0.02 * i)
    for i in range(10, 20):  # an RFC 4733 event: the start timestamp repeats for 200 ms
        stats.update(rtp(i, 1600), 0.02 * i, update_jitter=False)
    stats.update(rtp(19, 1600), 0.5)  # duplicate
    for i in range(20, 30):
        stats.update(rtp(i, 160 * i), 0.02 * i)
    assert stats.jitter == pytest.approx(0.0, abs=1e-6)
    assert stats.duplicates == 1 and stats.lost == -1


def test_jitter_at_other_clock_rates() -> None:
    stats = RtpReceiverStats(min_sequential=1)
    stats.update(rtp(0, 0), 0.0, clock_rate=16000)
    stats.update(rtp(1, 320), 0.030, clock_rate=16000)  # 10 ms late = 160 units
    assert stats.jitter == pytest.approx(10.0)
    assert stats.jitter_ms == pytest.approx(10.0 / 16)


def test_min_sequential_must_be_positive() -> None:
    with pytest.raises(RtpError):
        RtpReceiverStats(min_sequential=0)


# --- payload decoding ----------------------------------------------------------------------------


def test_payload_decoder_uses_g711() -> None:
    payload = bytes(range(256))
    assert np.array_equal(RtpPayloadDecoder("PCMU").decode(payload), ulaw_decode(payload))
    assert np.array_equal(RtpPayloadDecoder("pcma").decode(payload), alaw_decode(payload))
    assert RtpPayloadDecoder.for_payload_type(0).codec == "PCMU"
    assert RtpPayloadDecoder.for_payload_type(8).codec == "PCMA"
    silence = RtpPayloadDecoder("PCMU").decode(b"\xff" * 160)
    assert silence.dtype == np.int16 and not silence.any()
    with pytest.raises(RtpError, match="G722"):
        RtpPayloadDecoder("G722")
    with pytest.raises(RtpError, match="payload type 9"):
        RtpPayloadDecoder.for_payload_type(9)


# --- sending keys (RFC 4733) ------------------------------------------------------------------


def test_keys_sent_as_events_are_received_as_those_keys() -> None:
    sender = RtpSender(0, ssrc=7, initial_sequence=65534, initial_timestamp=2**32 - 400,
                       rng=random.Random(0))
    keys = DtmfSender("1w#A")
    receiver = DtmfReceiver(101)
    received: list[tuple[str, int]] = []
    packets: list[RtpPacket] = []
    started = 0
    while not keys.done:
        event = keys.next()
        if event is None:
            packet = RtpPacket.parse(sender.packet(b"\xff" * 160))
        else:
            payload, first = event
            if first:
                started = sender.timestamp
            packet = RtpPacket.parse(sender.event_packet(payload, 101, started, first))
            digit = receiver.feed(packet)
            if digit is not None:
                received.append((digit, packet.timestamp))
        packets.append(packet)
    assert [d for d, _ in received] == ["1", "#", "A"]
    assert keys.sent == 3
    # One sequence space for audio and events, wrapping; the clock runs on through events.
    assert all(seq_diff(b.sequence, a.sequence) == 1 for a, b in itertools.pairwise(packets))
    events = [p for p in packets if p.payload_type == 101]
    first_of_each = [p for p in events if p.marker]
    assert len(first_of_each) == 3 and all(p.timestamp in {t for _, t in received}
                                           for p in first_of_each)
    # 100 ms a key (5 frames, the last sent three times with the E bit), 100 ms apart, and
    # "w" half a second of audio.
    ends = [TelephoneEvent.parse(p.payload) for p in events if TelephoneEvent.parse(
        p.payload).end]
    assert len(ends) == 9 and {e.duration for e in ends} == {800}
    assert len(packets) == 3 * (7 + 5) + 25
    audio_after = packets[-1]
    assert audio_after.payload_type == 0
    assert ts_diff(audio_after.timestamp, packets[0].timestamp) == 160 * (len(packets) - 1)


def test_keys_that_are_not_keys_are_refused() -> None:
    with pytest.raises(RtpError, match="'x' is not a DTMF key"):
        DtmfSender("12x")
