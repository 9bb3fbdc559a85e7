"""Celery's schedules as the JSON a periodic entry stores, and back; and due times.

``{"kind": "interval", "every": 10.0, "relative": false}``,
``{"kind": "crontab", "minute": "*/5", "hour": "*", "day_of_week": "*",
"day_of_month": "*", "month_of_year": "*"}``, ``{"kind": "solar", "event": "sunset",
"lat": 48.85, "lon": 2.35}``. A crontab is read in the app's timezone (``timezone``,
``enable_utc``), as Celery's own scheduler reads it, and its due times are Celery's:
:func:`next_due` asks the schedule object itself, so DST is handled as Celery handles it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from datetime import datetime, timedelta
from typing import Any

from celery import Celery
from celery.schedules import BaseSchedule, crontab, schedule, solar

from kombu_pgqueue.schedule import MISSED, EntrySpec, Missed

#: beat_schedule's per-entry option naming what to do with missed due times
MISSED_OPTION = "pgqueue_missed"

CRON_FIELDS = ("minute", "hour", "day_of_week", "day_of_month", "month_of_year")


def _cron_field(value: Any) -> Any:
    if isinstance(value, (str, int)):
        return value
    if isinstance(value, Iterable):
        return sorted(value)
    raise ValueError(f"crontab field {value!r} cannot be stored")


def to_json(value: Any, name: str = "?") -> dict[str, Any]:
    """The stored form of a ``beat_schedule`` entry's ``schedule``."""
    if isinstance(value, (int, float)):
        value = timedelta(seconds=value)
    if isinstance(value, timedelta):
        return {"kind": "interval", "every": value.total_seconds(), "relative": False}
    if isinstance(value, crontab):
        return {
            "kind": "crontab",
            **{f: _cron_field(getattr(value, f"_orig_{f}")) for f in CRON_FIELDS},
        }
    if isinstance(value, solar):
        return {"kind": "solar", "event": value.event, "lat": value.lat, "lon": value.lon}
    if isinstance(value, schedule):
        every = value.run_every.total_seconds()
        return {"kind": "interval", "every": every, "relative": bool(value.relative)}
    raise ValueError(
        f"periodic entry {name!r}: {type(value).__name__} schedules cannot be stored in the "
        "database; celery_pgqueue.beat.Scheduler takes intervals (seconds, timedelta, "
        "celery.schedules.schedule), crontab and solar"
    )


def from_json(
    data: Mapping[str, Any], app: Celery, nowfun: Callable[[], datetime] | None = None
) -> BaseSchedule:
    """The schedule object of a stored entry, reading the time from ``nowfun``."""
    kind = data.get("kind")
    if kind == "interval":
        every = timedelta(seconds=float(data["every"]))
        return schedule(every, bool(data.get("relative")), nowfun=nowfun, app=app)
    if kind == "crontab":
        fields = {f: data.get(f, "*") for f in CRON_FIELDS}
        return crontab(**fields, nowfun=nowfun, app=app)
    if kind == "solar":
        return solar(data["event"], data["lat"], data["lon"], nowfun=nowfun, app=app)
    raise ValueError(f"unknown schedule kind {kind!r} in {dict(data)!r}")


def spec_of(name: str, entry: Mapping[str, Any]) -> EntrySpec:
    """An entry of Celery's ``beat_schedule`` as stored. Its options may say
    ``pgqueue_missed: "skip"`` (default ``"once"``); they are stored without it."""
    options = dict(entry.get("options") or {})
    missed = options.pop(MISSED_OPTION, "once")
    if missed not in MISSED:
        raise ValueError(
            f"periodic entry {name!r}: {MISSED_OPTION}={missed!r}, not one of {MISSED}"
        )
    sched = entry.get("schedule")
    if entry.get("relative") and isinstance(sched, (int, float, timedelta)):
        sched = schedule(sched, relative=True)
    return EntrySpec(
        name=name,
        task=entry["task"],
        schedule=to_json(sched, name),
        args=tuple(entry.get("args") or ()),
        kwargs=dict(entry.get("kwargs") or {}),
        options=options,
        missed=_missed(missed),
    )


def _missed(value: str) -> Missed:
    return "skip" if value == "skip" else "once"


class Clock:
    """The time a tick computes with, read by the schedule objects (their ``nowfun``).

    Written by the scheduler's tick only: one value per tick, so every entry of a tick
    is judged at the same instant."""

    def __init__(self) -> None:
        self.now = datetime.now().astimezone()

    def __call__(self) -> datetime:
        return self.now


def next_due(sched: BaseSchedule, after: datetime, clock: Clock) -> datetime:
    """The first due time of ``sched`` after due time ``after``, as Celery computes it.

    Celery's schedules answer "how long from now until the run after ``after``": added
    to now, that is the run's time, whatever now is (UTC arithmetic, exact to the
    microsecond), so every beat computes the same due times from the same row.
    """
    if isinstance(sched, schedule) and not isinstance(sched, (crontab, solar)):
        if not sched.relative:
            every: timedelta = sched.run_every
            return after + every
    remaining: timedelta = sched.remaining_estimate(after)
    return clock.now + remaining


def due_times(
    sched: BaseSchedule, last: datetime, clock: Clock, *, limit: int = 100_000
) -> tuple[list[datetime], datetime]:
    """The due times after ``last`` up to the clock's now, oldest first (at most
    ``limit``: the newest of them are kept), and the first one after now."""
    now = clock.now
    if isinstance(sched, schedule) and not isinstance(sched, (crontab, solar)):
        every = sched.run_every
        if not sched.relative and every > timedelta(0):
            count = max(0, math.floor((now - last) / every))
            first = max(1, count - limit + 1)
            return [last + every * k for k in range(first, count + 1)], last + every * (count + 1)
    found: list[datetime] = []
    due = next_due(sched, last, clock)
    while due <= now:
        found.append(due)
        if len(found) > limit:
            del found[0]
        following = next_due(sched, due, clock)
        if following <= due:  # a schedule that does not advance would loop forever
            raise ValueError(f"schedule {sched!r} gives {following} after {due}")
        due = following
    return found, due
