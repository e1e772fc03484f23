"""Business hours: a weekly schedule in a named time zone, with holidays.

An ``hours`` node (``prompts/demo.yaml``) says when the line is open::

    hours:
      timezone: America/New_York        # an IANA zone: daylight saving is the zone's business
      weekly:
        mon-fri: "08:00-18:00"
        sat: "09:00-12:00, 13:00-15:00"   # several ranges a day
        sun: closed
      holidays:                         # a date alone is closed all day;
        - 2025-12-25                    # a date with hours replaces that day's
        - {date: 2025-12-24, hours: "08:00-12:00"}
      open: menu
      closed: after_hours

Days are ``mon`` .. ``sun``, ranges of them (``mon-fri``, ``fri-mon``), comma lists
(``sat,sun``) or ``daily``; a day not named is closed. A range is ``HH:MM-HH:MM`` in the zone's
local (wall-clock) time, start included, end excluded; ``24:00`` ends at midnight; a range that
ends before it starts runs over midnight (``22:00-02:00`` on Friday is open until 2 am on
Saturday). A holiday replaces that whole local date, overnight spill included.

The check itself runs on the gateway's injected clock (:meth:`gateway.clock.Clock.wall`), so a
test sets the time of day instead of waiting for it.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import date, datetime, timedelta
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

__all__ = ["DAYS", "HoursError", "Schedule", "zone"]

DAYS = ("mon", "tue", "wed", "thu", "fri", "sat", "sun")
_RANGE = re.compile(r"^\s*([0-9]{1,2}):([0-9]{2})\s*-\s*([0-9]{1,2}):([0-9]{2})\s*$")

#: Minutes since local midnight: [start, end) pairs.
Ranges = tuple[tuple[int, int], ...]


class HoursError(ValueError):
    """A schedule entry that does not parse; ``key`` names the entry (a day spec or a date)."""

    def __init__(self, message: str, key: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.key = key


def zone(name: str) -> ZoneInfo:
    """The IANA zone ``name`` (raises :class:`HoursError` with a hint if there is none)."""
    try:
        return ZoneInfo(name)
    except (ZoneInfoNotFoundError, ValueError):
        raise HoursError(f"'{name}' is not a time zone: use an IANA name such as "
                         "America/New_York, Europe/Madrid or UTC", name) from None


def parse_days(spec: str) -> list[int]:
    """``mon-fri``, ``sat,sun``, ``daily`` -> weekday numbers (Monday = 0)."""
    days: list[int] = []
    for part in spec.lower().replace(" ", "").split(","):
        if part == "daily":
            days.extend(range(7))
            continue
        first, _, last = part.partition("-")
        if first not in DAYS or (last and last not in DAYS):
            raise HoursError(f"'{spec}' is not a day or a range of days (mon, tue, wed, thu, "
                             "fri, sat, sun; mon-fri; sat,sun; daily)", spec)
        a = DAYS.index(first)
        b = DAYS.index(last) if last else a
        days.extend((a + i) % 7 for i in range((b - a) % 7 + 1))
    return days


def parse_ranges(text: object, key: str | None = None) -> Ranges:
    """``"08:00-12:00, 13:00-17:00"`` (or a list of ranges, or ``closed``) -> minute ranges."""
    items: Iterable[object]
    if isinstance(text, str):
        if text.strip().lower() == "closed":
            return ()
        items = text.split(",")
    elif isinstance(text, list):
        items = text
    else:
        raise HoursError(f"hours are written \"08:00-18:00\" (quoted), not {text!r}", key)
    ranges: list[tuple[int, int]] = []
    for item in items:
        match = _RANGE.match(str(item))
        if match is None:
            raise HoursError(f"'{str(item).strip()}' is not a time range: write HH:MM-HH:MM, "
                             "such as 08:00-18:00, or 'closed'", key)
        h1, m1, h2, m2 = (int(g) for g in match.groups())
        for hour, minute in ((h1, m1), (h2, m2)):
            if hour > 24 or minute > 59 or (hour == 24 and minute != 0):
                raise HoursError(f"{hour:02d}:{minute:02d} is not a time of day", key)
        start, end = 60 * h1 + m1, 60 * h2 + m2
        if start == end:
            raise HoursError(f"'{str(item).strip()}' is open for no time at all", key)
        ranges.append((start, end))
    return tuple(ranges)


def _split(ranges: Ranges) -> tuple[Ranges, Ranges]:
    """Ranges of one day -> (that day's part, the next day's overnight spill)."""
    same: list[tuple[int, int]] = []
    spill: list[tuple[int, int]] = []
    for start, end in ranges:
        if end > start:
            same.append((start, end))
        else:
            same.append((start, 24 * 60))
            if end > 0:
                spill.append((0, end))
    return tuple(same), tuple(spill)


@dataclass(frozen=True)
class Schedule:
    """When a line is open: compiled from an ``hours`` node."""

    zone: ZoneInfo
    #: Per weekday (Monday = 0): own ranges and the spill into the next day.
    weekly: tuple[tuple[Ranges, Ranges], ...]
    #: Local dates that replace the weekly schedule: own ranges and spill.
    holidays: Mapping[date, tuple[Ranges, Ranges]]

    @classmethod
    def compile(cls, timezone: str, weekly: Mapping[str, object],
                holidays: Iterable[tuple[date, object]]) -> Schedule:
        """Build a schedule; raise :class:`HoursError` naming the entry that is wrong."""
        tz = zone(timezone)
        days: list[tuple[Ranges, Ranges] | None] = [None] * 7
        owner: list[str] = [""] * 7
        for spec, hours in weekly.items():
            ranges = _split(parse_ranges(hours, spec))
            for day in parse_days(spec):
                if days[day] is not None:
                    raise HoursError(f"'{spec}' gives {DAYS[day]} hours again ('{owner[day]}' "
                                     "already did): each day once", spec)
                days[day], owner[day] = ranges, spec
        special: dict[date, tuple[Ranges, Ranges]] = {}
        for when, hours in holidays:
            if when in special:
                raise HoursError(f"holiday {when.isoformat()} is listed twice", when.isoformat())
            special[when] = _split(parse_ranges(hours, when.isoformat()))
        return cls(tz, tuple(d if d is not None else ((), ()) for d in days), special)

    def _day(self, day: date) -> tuple[Ranges, Ranges]:
        found = self.holidays.get(day)
        return found if found is not None else self.weekly[day.weekday()]

    def is_open(self, when: datetime) -> bool:
        """Is the line open at ``when`` (an aware datetime, any zone)?"""
        if when.tzinfo is None:
            raise ValueError("is_open needs an aware datetime (with a time zone)")
        local = when.astimezone(self.zone)
        minute = local.hour * 60 + local.minute
        today = local.date()
        own, _ = self._day(today)
        if any(start <= minute < end for start, end in own):
            return True
        if today in self.holidays:
            return False  # a holiday replaces the whole date, the night before's spill too
        _, spill = self._day(today - timedelta(days=1))
        return any(start <= minute < end for start, end in spill)

    def is_open_at(self, epoch_s: float) -> bool:
        """:meth:`is_open` for a Unix time (what :meth:`gateway.clock.Clock.wall` reads)."""
        return self.is_open(datetime.fromtimestamp(epoch_s, tz=self.zone))

