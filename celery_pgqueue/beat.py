"""``celery beat`` with the schedule in the broker's database, on every node at once.

.. code-block:: console

    celery -A proj beat -S celery_pgqueue.beat:Scheduler      # on every node
    celery -A proj worker -B --scheduler celery_pgqueue.beat:Scheduler  # or in workers

or ``app.conf.beat_scheduler = "celery_pgqueue.beat:Scheduler"``. Every beat syncs
``beat_schedule`` into the database at its start; ``celery pgqueue schedule ...`` and
:class:`kombu_pgqueue.admin.Broker` add, change, pause and remove entries at run time.

One beat leads at a time (a session advisory lock, :class:`kombu_pgqueue.schedule.BeatSession`);
the others try for the lead every ``pgqueue_beat_poll_interval`` seconds. The leader
sends each due time in the database transaction that records it as sent, under the
condition that it was not yet (``sql/schedule.sql``, ``fire_periodic``): two leaders at
once, a restarted one, or one that lost the lead between deciding and sending cannot
send a due time twice. Settings (``app.conf``):

* ``pgqueue_beat_poll_interval`` (1.0 s): a follower's tries for the lead, and the
  leader's longest sleep (entries changed at run time take effect within it).
* ``pgqueue_beat_late_after`` (5.0 s): a send later than this after its due time is
  logged as a warning and counted (``late_count``, the metric ``pgqueue_beat_late_sends``).
* ``pgqueue_beat_catch_up`` (60.0 s): due times no older than this are each sent, late,
  when a beat takes over; when the oldest is older (no beat ran for longer), they are
  missed: sent once (the newest of them, as Celery's own scheduler does) or skipped,
  per entry (``options={"pgqueue_missed": "skip"}``).
* ``pgqueue_beat_idle_session_timeout`` (10.0 s): the server ends the session of a beat
  silent for this long (host or network lost), which frees the lead (PostgreSQL 14+).
* ``pgqueue_beat_node`` (``host:pid``): the name ``celery pgqueue schedule list`` shows.
* ``pgqueue_beat_exclusive`` (True): False makes every beat send as if it led, with no
  lock; the guard alone then keeps each due time to one send (the tests show it so).

docs/periodic-tasks.md has the bounds these give.
"""

from __future__ import annotations

import logging
import os
import socket
from typing import Any

import psycopg
from celery import beat
from celery.schedules import BaseSchedule, crontab

from kombu_pgqueue import admin
from kombu_pgqueue.schedule import BeatSession, Entry, EntrySpec, Fired

from ._schedules import Clock, due_times, from_json, spec_of

logger = logging.getLogger(__name__)

DEFAULTS = {
    "pgqueue_beat_poll_interval": 1.0,
    "pgqueue_beat_late_after": 5.0,
    "pgqueue_beat_catch_up": 60.0,
    "pgqueue_beat_idle_session_timeout": 10.0,
}


def _idle_timeout(setting: dict[str, float]) -> float:
    timeout = setting["pgqueue_beat_idle_session_timeout"]
    return max(timeout, 3 * setting["pgqueue_beat_poll_interval"]) if timeout > 0 else 0.0


class Scheduler(beat.Scheduler):  # type: ignore[misc]  # Celery is untyped
    """Celery's scheduler API over the broker's database (see the module docstring).

    The tick (Celery's beat thread) owns every attribute; nothing else writes them.
    ``clock`` is the tick's time: tests move it instead of sleeping.
    """

    def __init__(self, app: Any, *args: Any, clock: Clock | None = None, **kwargs: Any) -> None:
        conf = app.conf
        setting = {name: float(conf.get(name) or default) for name, default in DEFAULTS.items()}
        self.poll_interval = setting["pgqueue_beat_poll_interval"]
        self.late_after = setting["pgqueue_beat_late_after"]
        self.catch_up = setting["pgqueue_beat_catch_up"]
        self.node = conf.get("pgqueue_beat_node") or f"{socket.gethostname()}:{os.getpid()}"
        exclusive = conf.get("pgqueue_beat_exclusive")
        self.exclusive = True if exclusive is None else bool(exclusive)
        self.clock = clock or Clock()
        self._fixed_clock = clock is not None
        connection = app.connection_for_write()
        try:
            broker = admin.Broker.from_connection(connection)
        finally:
            connection.release()
        self.session = BeatSession(
            broker.conninfo,
            broker.schema,
            self.node,
            auto_migrate=broker.options.auto_migrate,
            # a live beat talks to the server every poll interval at least: never end
            # its session for being quiet that long
            idle_session_timeout=_idle_timeout(setting),
        )
        #: beat_schedule as stored, until a tick has written it to the database
        self._unsynced: list[EntrySpec] | None = None
        #: the entries the last tick read
        self._entries: list[Entry] = []
        #: (name, revision) -> schedule object
        self._schedules: dict[tuple[str, int], BaseSchedule] = {}
        self._was_leading = False
        #: (name, revision) of entries whose schedule failed, logged once each
        self._broken: set[tuple[str, int]] = set()
        super().__init__(app, *args, **kwargs)

    # -- Celery's Scheduler API ----------------------------------------------------------

    def setup_schedule(self) -> None:
        """Read ``beat_schedule`` (and Celery's own ``celery.backend_cleanup``); the first
        tick writes it to the database, so a database not yet up delays it only."""
        wanted = dict(self.app.conf.beat_schedule or {})
        if (
            self.app.conf.result_expires
            and not self.app.backend.supports_autoexpire
            and "celery.backend_cleanup" not in wanted
        ):
            wanted["celery.backend_cleanup"] = {
                "task": "celery.backend_cleanup",
                "schedule": crontab("0", "4", "*"),
                "options": {"expires": 12 * 3600},
            }
        self._unsynced = [spec_of(name, entry) for name, entry in wanted.items()]

    def tick(self, *args: Any, **kwargs: Any) -> float:
        """Send what is due if this beat leads; return the seconds to sleep."""
        if not self._fixed_clock:
            self.clock.now = self.app.now()
        try:
            if self._unsynced is not None:
                synced = self.session.sync_config(self._unsynced, now=self.clock.now)
                if synced.written or synced.removed:
                    logger.info(
                        "beat: beat_schedule synced (written: %s; removed: %s)",
                        ", ".join(synced.written) or "-",
                        ", ".join(synced.removed) or "-",
                    )
                self._unsynced = None
            leading = self.session.lead(self.clock.now) if self.exclusive else True
            if leading != self._was_leading:
                logger.info("beat: %s %s", self.node, "leads" if leading else "no longer leads")
                self._was_leading = leading
            if not leading:
                return self.poll_interval
            return self._send_due()
        except psycopg.OperationalError as exc:
            logger.warning("beat: the broker's database: %s (trying again)", exc)
            self.session.discard()
            self._was_leading = False
            return self.poll_interval

    def _send_due(self) -> float:
        self._entries = self.session.entries()
        now = self.clock.now
        sleep = self.poll_interval
        for entry in self._entries:
            try:
                sched = self._schedule(entry)
                dues, following = due_times(sched, entry.last_due, self.clock)
            except Exception:  # one broken entry (solar without ephem) stops no other
                if (entry.name, entry.revision) not in self._broken:
                    self._broken.add((entry.name, entry.revision))
                    logger.exception("beat: entry %r cannot be scheduled; skipped", entry.name)
                continue
            if dues and (now - dues[0]).total_seconds() > self.catch_up:
                # missed while no beat ran: the newest once, or none
                self._fire(entry, dues[-1], send=entry.missed == "once")
            else:
                for due in dues:
                    if not self._fire(entry, due, send=True):
                        break
            sleep = min(sleep, (following - now).total_seconds())
        return max(sleep, 0.0) or 0.001

    def _schedule(self, entry: Entry) -> BaseSchedule:
        key = (entry.name, entry.revision)
        found = self._schedules.get(key)
        if found is None:
            self._schedules = {k: v for k, v in self._schedules.items() if k[0] != entry.name}
            found = self._schedules[key] = from_json(entry.schedule, self.app, self.clock)
        return found

    def _fire(self, entry: Entry, due: Any, *, send: bool) -> bool:
        """Send (or skip) ``due``; False when it was not this beat's to send or failed."""
        try:
            with self.session.firing(
                entry, due, self.clock.now, send=send, late_after=self.late_after
            ) as fired:
                if fired is None:
                    return False
                if send:
                    self._publish(entry, fired)
        except psycopg.OperationalError:
            raise
        except Exception:
            logger.exception("beat: sending %r due %s failed (tried again)", entry.name, due)
            return False
        if not send:
            logger.warning("beat: %r missed due times up to %s: skipped", entry.name, due)
        elif fired.lateness > self.late_after:
            logger.warning(
                "beat: sent %r due %s %.1fs late (pgqueue_beat_late_after: %.1fs)",
                entry.name,
                due.isoformat(),
                fired.lateness,
                self.late_after,
            )
        else:
            logger.info("beat: sent %r (%s) due %s", entry.name, entry.task, due.isoformat())
        return True

    def _publish(self, entry: Entry, fired: Fired) -> None:
        options = dict(entry.options)
        headers = dict(options.pop("headers", None) or {})
        headers.update(
            celery_beat_task=True,
            pgqueue_beat_entry=entry.name,
            pgqueue_beat_due=fired.due.isoformat(),
        )
        # no publish retry: a failed publish rolls the due time back for the next tick
        options["retry"] = False
        task = self.app.tasks.get(entry.task)
        if task is not None:
            task.apply_async(
                entry.args, entry.kwargs, producer=self.producer, headers=headers, **options
            )
        else:
            self.app.send_task(
                entry.task,
                entry.args,
                entry.kwargs,
                producer=self.producer,
                headers=headers,
                **options,
            )

    def get_schedule(self) -> dict[str, beat.ScheduleEntry]:
        """The entries as the last tick read them, as Celery's entries (read only)."""
        return {
            entry.name: beat.ScheduleEntry(
                name=entry.name,
                task=entry.task,
                last_run_at=entry.last_run_at,
                total_run_count=entry.total_run_count,
                schedule=self._schedule(entry),
                args=entry.args,
                kwargs=entry.kwargs,
                options=entry.options,
                app=self.app,
            )
            for entry in self._entries
        }

    def set_schedule(self, schedule: Any) -> None:
        """Celery's base class sets ``self.schedule``; the database holds it here."""

    schedule = property(get_schedule, set_schedule)

    def sync(self) -> None:
        """Nothing to write: every send commits its own state."""

    def close(self) -> None:
        """Close the session, which gives the lead up at once."""
        self.session.close()
        super().close()

    @property
    def info(self) -> str:
        return f"    . db -> schema {self.session.schema!r}, node {self.node}"
