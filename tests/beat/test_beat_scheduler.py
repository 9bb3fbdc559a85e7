"""celery_pgqueue.beat.Scheduler in this process, on a moved clock (issue 44).

Each test drives ``tick()`` as ``celery beat`` does, with the scheduler's clock set by
the test instead of slept for, against the real database; the sends are the messages
in the schema's queues (``conftest.sent``).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from datetime import datetime, timedelta, timezone
from zoneinfo import ZoneInfo

import psycopg
import pytest
from celery import Celery
from celery.beat import ScheduleEntry
from celery.schedules import crontab
from periodic_app import T0, every, make_app, sent
from waiting import wait_for

from celery_pgqueue._schedules import Clock, to_json
from celery_pgqueue.beat import Scheduler
from kombu_pgqueue import admin
from kombu_pgqueue.schedule import BeatSession, EntrySpec


@pytest.fixture
def clock() -> Clock:
    found = Clock()
    found.now = T0
    return found


@pytest.fixture
def scheduler(periodic: Celery, clock: Clock) -> Iterator[Scheduler]:
    found = Scheduler(periodic, clock=clock)
    try:
        yield found
    finally:
        found.close()


def run_until(scheduler: Scheduler, clock: Clock, end: datetime, step: timedelta) -> None:
    """Tick as beat does, moving the clock by ``step`` up to ``end``."""
    while clock.now <= end:
        scheduler.tick()
        clock.now += step


def dues(db: psycopg.Connection, schema: str, entry: str) -> list[datetime]:
    return [s.due for s in sent(db, schema) if s.entry == entry]


def test_fire_periodic_sends_a_due_time_once_when_two_beats_race(
    broker: admin.Broker, periodic: Celery, db: psycopg.Connection, schema: str
) -> None:
    # two beats that both decided to send the same due time: the second waits for the
    # first's row lock, then finds the due time taken and sends nothing
    broker.save_periodic(every("race", 1.0), now=T0)
    first = BeatSession(broker.conninfo, schema, "first")
    second = BeatSession(broker.conninfo, schema, "second")
    [entry] = first.entries()
    due, now = T0 + timedelta(seconds=1), T0 + timedelta(seconds=1.5)
    outcome: list[object] = []
    try:
        with periodic.producer_or_acquire() as producer:
            with first.firing(entry, due, now, late_after=5.0) as won:
                assert won is not None
                periodic.send_task("periodic.tick", producer=producer, headers=_headers(due))

                def race() -> None:
                    with second.firing(entry, due, now, late_after=5.0) as lost:
                        outcome.append(lost)

                racer = threading.Thread(target=race)
                racer.start()
                wait_for(lambda: _waits_for_lock(db, "second"), 10, "the second beat to wait")
            racer.join(10)
    finally:
        first.close()
        second.close()
    assert outcome == [None]
    assert dues(db, schema, "race") == [due]
    [stored] = broker.periodic_entries()
    assert (stored.last_due, stored.total_run_count) == (due, 1)


def _headers(due: datetime) -> dict[str, object]:
    return {"pgqueue_beat_entry": "race", "pgqueue_beat_due": due.isoformat()}


def _waits_for_lock(db: psycopg.Connection, node: str) -> bool:
    row = db.execute(
        "SELECT count(*) FROM pg_stat_activity WHERE application_name = %s"
        " AND wait_event_type = 'Lock'",
        (f"pgqueue beat {node}",),
    ).fetchone()
    return bool(row and row[0])


def test_tick_sends_each_due_time_once_and_a_restarted_beat_sends_none_again(
    broker: admin.Broker, periodic: Celery, clock: Clock, db: psycopg.Connection, schema: str
) -> None:
    broker.save_periodic(every("tick", 2.0), now=T0)
    end = T0 + timedelta(seconds=10)
    first = Scheduler(periodic, clock=clock)
    try:
        run_until(first, clock, end, timedelta(seconds=0.5))
    finally:
        first.close()
    # a restarted beat, whose clock is behind: nothing sent twice
    clock.now = T0
    again = Scheduler(periodic, clock=clock)
    try:
        run_until(again, clock, end, timedelta(seconds=0.5))
    finally:
        again.close()
    assert dues(db, schema, "tick") == [T0 + timedelta(seconds=s) for s in (2, 4, 6, 8, 10)]


def test_an_entry_changed_and_paused_at_run_time_takes_effect_without_a_restart(
    broker: admin.Broker, scheduler: Scheduler, clock: Clock, db: psycopg.Connection, schema: str
) -> None:
    broker.save_periodic(every("tick", 10.0), now=T0)
    step = timedelta(seconds=0.5)
    run_until(scheduler, clock, T0 + timedelta(seconds=10), step)
    assert dues(db, schema, "tick") == [T0 + timedelta(seconds=10)]
    # every 2 s from the last due time on
    assert broker.save_periodic(every("tick", 2.0))
    run_until(scheduler, clock, T0 + timedelta(seconds=14), step)
    assert dues(db, schema, "tick")[1:] == [T0 + timedelta(seconds=s) for s in (12, 14)]
    assert broker.pause_periodic("tick")
    run_until(scheduler, clock, T0 + timedelta(seconds=30), step)
    assert len(dues(db, schema, "tick")) == 3
    # resumed at 30: the paused due times are not sent, the next is 32
    assert broker.resume_periodic("tick", now=T0 + timedelta(seconds=30))
    run_until(scheduler, clock, T0 + timedelta(seconds=33), step)
    assert dues(db, schema, "tick")[3:] == [T0 + timedelta(seconds=32)]
    assert broker.remove_periodic("tick")
    run_until(scheduler, clock, T0 + timedelta(seconds=40), step)
    assert len(dues(db, schema, "tick")) == 4


def test_a_takeover_sends_each_late_due_time_and_missed_ones_once_or_never(
    broker: admin.Broker,
    scheduler: Scheduler,
    clock: Clock,
    db: psycopg.Connection,
    schema: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    broker.save_periodic(every("late", 1.0), now=T0)
    broker.save_periodic(every("once", 10.0), now=T0)
    broker.save_periodic(every("skip", 10.0, missed="skip"), now=T0)
    # no beat for 7.5 s: within the catch-up window, each due time is sent, late; two
    # of them later than late_after (5 s), which says so
    clock.now = T0 + timedelta(seconds=7.5)
    with caplog.at_level(logging.WARNING, "celery_pgqueue.beat"):
        scheduler.tick()
    assert dues(db, schema, "late") == [T0 + timedelta(seconds=s) for s in range(1, 8)]
    assert [r.getMessage().split(" due ")[0] for r in caplog.records] == ["beat: sent 'late'"] * 2
    # no beat for 10 minutes: missed, beyond the window; the newest is due now
    clock.now = T0 + timedelta(minutes=10, seconds=5)
    scheduler.tick()
    assert len(dues(db, schema, "late")) == 8
    assert dues(db, schema, "once") == [T0 + timedelta(minutes=10)]
    assert dues(db, schema, "skip") == []
    stored = {e.name: e for e in broker.periodic_entries()}
    assert stored["skip"].last_due == T0 + timedelta(minutes=10)
    assert stored["late"].late_count == 2
    assert stored["once"].last_lateness == pytest.approx(5.0)


def test_beat_schedule_is_synced_at_start_and_runtime_entries_stay(
    dsn: str, schema: str, broker: admin.Broker, clock: Clock
) -> None:
    broker.save_periodic(every("added", 60.0))
    first = make_app(dsn, schema)
    first.conf.beat_schedule = {
        "a": {"task": "periodic.tick", "schedule": 5.0, "args": (1,)},
        "b": {"task": "periodic.tick", "schedule": crontab(minute="*/15")},
    }
    Scheduler(first, clock=clock).tick()
    assert [e.name for e in broker.periodic_entries()] == ["a", "added", "b"]
    broker.pause_periodic("a")
    second = make_app(dsn, schema)
    second.conf.beat_schedule = {
        "a": {"task": "periodic.tick", "schedule": 5.0, "args": (2,), "options": {"queue": "q"}}
    }
    Scheduler(second, clock=clock).tick()
    stored = {e.name: e for e in broker.periodic_entries()}
    assert sorted(stored) == ["a", "added"]
    assert (stored["a"].args, stored["a"].options, stored["a"].enabled) == (
        [2],
        {"queue": "q"},
        False,
    )
    assert stored["a"].revision == 3  # written, paused, written again
    first.close()
    second.close()


@pytest.mark.parametrize(
    "cron",
    [crontab(minute=30, hour=2), crontab(minute="0,30"), crontab(minute=15, hour="1-3")],
    ids=["02:30", "half-hourly", "01-03:15"],
)
@pytest.mark.parametrize(
    "start",
    [
        datetime(2027, 3, 27, 18, tzinfo=timezone.utc),
        datetime(2027, 10, 30, 18, tzinfo=timezone.utc),
    ],
    ids=["spring", "autumn"],
)
def test_a_crontab_across_a_dst_change_fires_as_celerys_own_scheduler(
    dsn: str,
    schema: str,
    broker: admin.Broker,
    cron: crontab,
    start: datetime,
    db: psycopg.Connection,
) -> None:
    # Europe/Paris: 2027-03-28 02:00 -> 03:00, 2027-10-31 03:00 -> 02:00. Both
    # schedulers tick every minute for 26 hours around it; Celery's own entry is due where ours
    # sends, and ours stores the due time Celery's crontab gives.
    conf = {"timezone": "Europe/Paris", "enable_utc": True}
    app = make_app(dsn, schema, conf=conf)
    app.conf.beat_schedule = {"cron": {"task": "periodic.tick", "schedule": cron}}
    clock = Clock()
    clock.now = start
    ours = Scheduler(app, clock=clock)
    theirs_schedule = crontab(**_fields(cron), nowfun=lambda: clock.now, app=app)
    theirs = ScheduleEntry(
        name="cron", task="periodic.tick", schedule=theirs_schedule, last_run_at=start, app=app
    )
    celery_fired: list[datetime] = []
    ours_fired: list[datetime] = []
    seen = 0
    try:
        while clock.now < start + timedelta(hours=26):
            ours.tick()
            found = dues(db, schema, "cron")
            if len(found) > seen:
                ours_fired.append(clock.now)
                seen = len(found)
            is_due, _ = theirs.is_due()
            if is_due:
                celery_fired.append(clock.now)
                theirs = theirs._next_instance(clock.now)
            clock.now += timedelta(minutes=1)
    finally:
        ours.close()
        app.close()
    assert ours_fired == celery_fired
    assert ours_fired
    paris = ZoneInfo("Europe/Paris")
    assert [d.astimezone(paris).replace(second=0) for d in dues(db, schema, "cron")] == [
        f.astimezone(paris) for f in ours_fired
    ]


def _fields(cron: crontab) -> dict[str, object]:
    stored = to_json(cron)
    return {k: v for k, v in stored.items() if k != "kind"}


def test_an_entry_that_cannot_be_scheduled_stops_no_other(
    broker: admin.Broker,
    scheduler: Scheduler,
    clock: Clock,
    db: psycopg.Connection,
    schema: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    broker.save_periodic(every("good", 1.0), now=T0)
    broken = {"kind": "solar", "event": "sunset", "lat": 48.85, "lon": 2.35}
    broker.save_periodic(EntrySpec(name="broken", task="periodic.tick", schedule=broken), now=T0)
    bad_cron = {"kind": "crontab", "minute": "61"}
    broker.save_periodic(EntrySpec(name="cron", task="periodic.tick", schedule=bad_cron), now=T0)
    run_until(scheduler, clock, T0 + timedelta(seconds=3), timedelta(seconds=1))
    assert dues(db, schema, "good") == [T0 + timedelta(seconds=s) for s in (1, 2, 3)]
    assert [s.entry for s in sent(db, schema)] == ["good"] * 3
    logged = [r.getMessage() for r in caplog.records if "cannot be scheduled" in r.getMessage()]
    assert sorted(logged) == [  # once each, not at every tick
        "beat: entry 'broken' cannot be scheduled; skipped",
        "beat: entry 'cron' cannot be scheduled; skipped",
    ]
