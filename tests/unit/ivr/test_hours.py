"""Business hours: weekly schedules in a named zone, overnight ranges, holidays, DST, and an
``hours`` node routing a call by the injected clock's time of day."""

from __future__ import annotations

from datetime import date, datetime
from zoneinfo import ZoneInfo

import pytest

from gateway.ivr.hours import HoursError, Schedule, parse_days, parse_ranges
from tests.support.clocks import VirtualClock

NY = ZoneInfo("America/New_York")


def at(text: str, tz: ZoneInfo = NY) -> datetime:
    return datetime.fromisoformat(text).replace(tzinfo=tz)


OFFICE = Schedule.compile(
    "America/New_York",
    {"mon-fri": "08:00-12:00, 13:00-18:00", "sat": ["09:00-12:00"], "sun": "closed"},
    [(date(2025, 12, 25), "closed"), (date(2025, 12, 24), "08:00-12:00")],
)


@pytest.mark.parametrize(
    ("when", "is_open"),
    [
        ("2025-06-16 07:59", False),  # Monday, before opening
        ("2025-06-16 08:00", True),  # the start is included
        ("2025-06-16 12:30", False),  # lunch
        ("2025-06-16 17:59", True),
        ("2025-06-16 18:00", False),  # the end is excluded
        ("2025-06-21 10:00", True),  # Saturday
        ("2025-06-21 12:00", False),
        ("2025-06-22 10:00", False),  # Sunday, closed
        ("2025-12-25 10:00", False),  # Christmas, a Thursday
        ("2025-12-24 11:00", True),  # Christmas Eve's own hours
        ("2025-12-24 14:00", False),
    ],
)
def test_weekly_hours_and_holidays_in_local_time(when: str, is_open: bool) -> None:
    assert OFFICE.is_open(at(when)) is is_open


def test_the_zone_decides_not_the_server() -> None:
    utc = ZoneInfo("UTC")
    # 12:30 UTC is 08:30 in New York in June (EDT, -4) but 07:30 in January (EST, -5).
    assert OFFICE.is_open(at("2025-06-16 12:30", utc))
    assert not OFFICE.is_open(at("2025-01-13 12:30", utc))
    assert OFFICE.is_open(at("2025-01-13 13:30", utc))


def test_daylight_saving_days_keep_wall_clock_hours() -> None:
    # 2025-03-09 (Sunday) New York springs forward; Monday 08:00 EDT = 12:00 UTC.
    monday = Schedule.compile("America/New_York", {"mon": "08:00-09:00"}, [])
    assert monday.is_open(at("2025-03-10 12:00", ZoneInfo("UTC")))
    assert not monday.is_open(at("2025-03-10 13:00", ZoneInfo("UTC")))
    # The week before (EST), 08:00 local = 13:00 UTC.
    assert monday.is_open(at("2025-03-03 13:00", ZoneInfo("UTC")))
    assert not monday.is_open(at("2025-03-03 12:00", ZoneInfo("UTC")))


def test_a_range_past_midnight_opens_the_next_morning_unless_that_date_is_a_holiday() -> None:
    night = Schedule.compile("Europe/Madrid", {"fri": "22:00-02:00"}, [(date(2025, 6, 28), [])])
    madrid = ZoneInfo("Europe/Madrid")
    assert night.is_open(at("2025-06-20 23:00", madrid))  # Friday night
    assert night.is_open(at("2025-06-21 01:59", madrid))  # Saturday early morning
    assert not night.is_open(at("2025-06-21 02:00", madrid))
    assert not night.is_open(at("2025-06-20 21:59", madrid))
    assert night.is_open(at("2025-06-27 23:00", madrid))
    assert not night.is_open(at("2025-06-28 01:00", madrid))  # Saturday 28th is a holiday


def test_day_specs() -> None:
    assert parse_days("mon-fri") == [0, 1, 2, 3, 4]
    assert parse_days("fri-mon") == [4, 5, 6, 0]
    assert parse_days("sat, sun") == [5, 6]
    assert parse_days("daily") == list(range(7))
    assert parse_ranges("08:00-24:00") == ((480, 1440),)
    assert parse_ranges("Closed") == ()
    with pytest.raises(HoursError, match="not a day"):
        parse_days("weekdays")
    with pytest.raises(HoursError, match="open for no time"):
        parse_ranges("09:00-09:00")
    with pytest.raises(HoursError, match="quoted"):
        parse_ranges(540)


def test_naive_times_are_refused() -> None:
    with pytest.raises(ValueError, match="aware"):
        OFFICE.is_open(datetime(2025, 6, 16, 10, 0))


def test_the_virtual_clock_tells_the_time_of_day() -> None:
    clock = VirtualClock()
    clock.set_wall(at("2025-06-16 10:00").timestamp())
    assert OFFICE.is_open_at(clock.wall())
    clock.set_wall(at("2025-06-16 19:00").timestamp())
    assert not OFFICE.is_open_at(clock.wall())
