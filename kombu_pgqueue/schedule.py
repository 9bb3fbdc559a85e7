"""Periodic task entries in the broker's database, and the beats' leadership.

The storage half of ``celery_pgqueue.beat`` (a ``celery beat`` scheduler that every
node may run); it knows nothing of Celery. An entry's ``schedule`` is JSON that the
Celery side writes and reads; here it is data.

* :class:`EntrySpec` is an entry as a user or ``beat_schedule`` gives it, :class:`Entry`
  one as stored (with its last due time and run counts), :class:`Leader` the beat that
  leads.
* :func:`entries`, :func:`save`, :func:`sync_config`, :func:`pause`, :func:`resume`,
  :func:`remove` and :func:`leader` run one statement each on a connection the caller
  gives (:class:`kombu_pgqueue.admin.Broker` has a method for each).
* :class:`BeatSession` is a beat's own connection: it takes the lead
  (:meth:`BeatSession.lead`, a session advisory lock) and sends a due time in the
  transaction that records it (:meth:`BeatSession.firing`). That transaction, not
  the lock, is what keeps a due time from being sent twice: see ``sql/schedule.sql``.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Literal

import psycopg

from . import _sql, migrations, transactions
from ._options import check_schema

__all__ = [
    "BeatSession",
    "Entry",
    "EntrySpec",
    "Fired",
    "Leader",
    "Missed",
    "entries",
    "leader",
    "pause",
    "remove",
    "resume",
    "save",
    "sync_config",
]

#: what a beat does with due times missed for longer than its catch-up window
Missed = Literal["once", "skip"]
MISSED: tuple[Missed, ...] = ("once", "skip")

Origin = Literal["config", "runtime"]


@dataclass(frozen=True, slots=True, kw_only=True)
class EntrySpec:
    """A periodic entry as given: ``schedule`` is the scheduler's JSON object."""

    name: str
    task: str
    schedule: dict[str, Any]
    args: Sequence[Any] = ()
    kwargs: dict[str, Any] = field(default_factory=dict)
    options: dict[str, Any] = field(default_factory=dict)
    missed: Missed = "once"

    def __post_init__(self) -> None:
        if not self.name:
            raise ValueError("a periodic entry needs a name")
        if not self.task:
            raise ValueError(f"periodic entry {self.name!r} needs a task name")
        if self.missed not in MISSED:
            raise ValueError(
                f"periodic entry {self.name!r}: missed={self.missed!r}, not one of {MISSED}"
            )

    def params(self, origin: Origin, now: datetime | None) -> dict[str, Any]:
        """The ``save_periodic`` statement's parameters."""
        try:
            encoded = {
                "schedule": json.dumps(self.schedule, sort_keys=True),
                "args": json.dumps(list(self.args)),
                "kwargs": json.dumps(self.kwargs, sort_keys=True),
                "options": json.dumps(self.options, sort_keys=True),
            }
        except TypeError as exc:
            raise ValueError(
                f"periodic entry {self.name!r} must be JSON (its schedule, args, kwargs and "
                f"options are stored in the database): {exc}"
            ) from exc
        return {
            "name": self.name,
            "task": self.task,
            "missed": self.missed,
            "origin": origin,
            "now": now,
            **encoded,
        }


@dataclass(frozen=True, slots=True, kw_only=True)
class Entry:
    """A stored periodic entry (statement ``periodic_entries``).

    ``last_due`` is the latest due time sent or skipped (the creation time before the
    first); ``last_run_at`` when the last send committed; ``late_count`` how many sends
    were later than the sending beat's ``late_after``; ``last_lateness`` the last
    send's, in seconds. ``revision`` grows with every change.
    """

    name: str
    task: str
    schedule: dict[str, Any]
    args: list[Any]
    kwargs: dict[str, Any]
    options: dict[str, Any]
    missed: Missed
    enabled: bool
    origin: Origin
    revision: int
    last_due: datetime
    last_run_at: datetime | None
    total_run_count: int
    late_count: int
    last_lateness: float | None
    created_at: datetime
    updated_at: datetime

    @classmethod
    def from_row(cls, row: Sequence[Any]) -> Entry:
        (name, task, schedule, args, kwargs, options, missed, enabled, origin, revision,
         last_due, last_run_at, total, late, lateness, created_at, updated_at) = row  # fmt: skip
        return cls(
            name=name,
            task=task,
            schedule=schedule,
            args=args,
            kwargs=kwargs,
            options=options,
            missed=missed,
            enabled=enabled,
            origin=origin,
            revision=int(revision),
            last_due=last_due,
            last_run_at=last_run_at,
            total_run_count=int(total),
            late_count=int(late),
            last_lateness=lateness,
            created_at=created_at,
            updated_at=updated_at,
        )

    def spec(self) -> EntrySpec:
        """What would save this entry as it is."""
        return EntrySpec(
            name=self.name,
            task=self.task,
            schedule=self.schedule,
            args=self.args,
            kwargs=self.kwargs,
            options=self.options,
            missed=self.missed,
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class Leader:
    """The leading beat: its node name, its database session and since when it leads."""

    node: str
    backend_pid: int
    since: datetime


@dataclass(frozen=True, slots=True, kw_only=True)
class Fired:
    """A due time this beat won (:meth:`BeatSession.firing`): publish it now."""

    name: str
    due: datetime
    lateness: float


@dataclass(frozen=True, slots=True, kw_only=True)
class Synced:
    """What :func:`sync_config` changed: entries written (new or changed) and removed."""

    written: list[str]
    removed: list[str]


def _rows(
    conn: psycopg.Connection[Any], schema: str, name: str, params: dict[str, Any]
) -> list[tuple[Any, ...]]:
    cur = conn.execute(_sql.queries(schema)[name], params)
    return cur.fetchall() if cur.description else []


def entries(
    conn: psycopg.Connection[Any], schema: str, *, enabled_only: bool = False
) -> list[Entry]:
    """Every entry by name (``enabled_only``: those not paused)."""
    rows = _rows(conn, schema, "periodic_entries", {"enabled_only": enabled_only})
    return [Entry.from_row(row) for row in rows]


def save(
    conn: psycopg.Connection[Any],
    schema: str,
    spec: EntrySpec,
    *,
    origin: Origin = "runtime",
    now: datetime | None = None,
) -> bool:
    """Add ``spec`` or change the entry of its name; return whether anything changed.

    A changed entry keeps its last due time, its counts and its pause."""
    found = _rows(conn, schema, "save_periodic", spec.params(origin, now))
    return bool(found and found[0][1])


def sync_config(
    conn: psycopg.Connection[Any],
    schema: str,
    specs: Sequence[EntrySpec],
    *,
    now: datetime | None = None,
) -> Synced:
    """Make the ``config`` entries those of ``specs`` (a beat's ``beat_schedule``), in
    one transaction; entries added at run time stay as they are."""
    with conn.transaction():
        written = [s.name for s in specs if save(conn, schema, s, origin="config", now=now)]
        names = [s.name for s in specs]
        removed = [row[0] for row in _rows(conn, schema, "drop_config_periodic", {"names": names})]
    return Synced(written=written, removed=removed)


def pause(
    conn: psycopg.Connection[Any], schema: str, name: str, now: datetime | None = None
) -> bool:
    """Pause entry ``name``; False if there is none."""
    return bool(_rows(conn, schema, "pause_periodic", {"name": name, "now": now}))


def resume(
    conn: psycopg.Connection[Any], schema: str, name: str, now: datetime | None = None
) -> bool:
    """Resume paused entry ``name`` from ``now`` (its paused due times are not sent);
    False if there is no paused entry of that name."""
    return bool(_rows(conn, schema, "resume_periodic", {"name": name, "now": now}))


def remove(conn: psycopg.Connection[Any], schema: str, name: str) -> bool:
    """Remove entry ``name``; False if there is none. A ``config`` entry comes back at
    the next beat's start unless it is removed from ``beat_schedule`` too."""
    return bool(_rows(conn, schema, "remove_periodic", {"name": name}))


def leader(conn: psycopg.Connection[Any], schema: str) -> Leader | None:
    """The leading beat, or None while none leads."""
    found = _rows(conn, schema, "beat_leader", {"schema": schema})
    if not found:
        return None
    node, pid, since = found[0]
    return Leader(node=node, backend_pid=int(pid), since=since)


class BeatSession:
    """A beat's connection to the broker's database: its leadership and its sends.

    Owned by one beat's scheduler, used from its thread only. The connection is opened
    on first use and again after it breaks (then the leadership is lost with it:
    :meth:`lead` tries again). ``idle_session_timeout`` (seconds, PostgreSQL 14 and
    later) makes the server end the session of a beat that stopped talking to it (its
    host or network lost), which frees the lock for the others; a live beat talks to
    it at every tick.
    """

    def __init__(
        self,
        conninfo: str,
        schema: str,
        node: str,
        *,
        auto_migrate: bool = True,
        idle_session_timeout: float = 10.0,
    ) -> None:
        self.conninfo = conninfo
        self.schema = check_schema(schema)
        self.node = node
        self.auto_migrate = auto_migrate
        self.idle_session_timeout = idle_session_timeout
        self._conn: psycopg.Connection[Any] | None = None
        #: whether this session holds the lock; written by lead() and by a broken
        #: connection's discard only
        self._leading = False

    @property
    def leading(self) -> bool:
        """Whether this beat held the lead at its last statement."""
        return self._leading

    def _connection(self) -> psycopg.Connection[Any]:
        if self._conn is not None and not self._conn.closed:
            return self._conn
        self._leading = False
        conn = psycopg.connect(
            self.conninfo, autocommit=True, application_name=f"pgqueue beat {self.node}"[:63]
        )
        try:
            migrations.ensure(conn, self.schema, auto_migrate=self.auto_migrate)
            if conn.info.server_version >= 140000 and self.idle_session_timeout > 0:
                conn.execute(
                    "SELECT set_config('idle_session_timeout', %s, false)",
                    (f"{int(self.idle_session_timeout * 1000)}ms",),
                )
        except BaseException:
            conn.close()
            raise
        self._conn = conn
        return conn

    @contextmanager
    def _using(self) -> Iterator[psycopg.Connection[Any]]:
        conn = self._connection()
        try:
            yield conn
        except psycopg.OperationalError:
            if conn.broken or conn.closed:
                self.discard()
            raise

    def discard(self) -> None:
        """Close the connection (the lead goes with it); the next call opens another."""
        self._leading = False
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.close()

    #: a beat that stops gives up the lead by closing its session: the next try of
    #: another beat takes it
    close = discard

    def lead(self, now: datetime | None = None) -> bool:
        """Take the lead if no other beat's session holds it; True while this one does.

        A session lock is held until released, so a leader only checks that its
        session lives (the statement succeeding is the proof)."""
        with self._using() as conn:
            if self._leading:
                conn.execute("SELECT 1")
                return True
            row = _rows(conn, self.schema, "try_lead_beat", {"schema": self.schema})
            if row and row[0][0]:
                _rows(conn, self.schema, "note_beat_leader", {"node": self.node, "now": now})
                self._leading = True
        return self._leading

    def entries(self) -> list[Entry]:
        """The enabled entries, as now stored."""
        with self._using() as conn:
            return entries(conn, self.schema, enabled_only=True)

    def sync_config(self, specs: Sequence[EntrySpec], now: datetime | None = None) -> Synced:
        """:func:`sync_config` on this session's connection."""
        with self._using() as conn:
            return sync_config(conn, self.schema, specs, now=now)

    @contextmanager
    def firing(
        self,
        entry: Entry,
        due: datetime,
        now: datetime,
        *,
        send: bool = True,
        late_after: float,
    ) -> Iterator[Fired | None]:
        """Record due time ``due`` of ``entry`` as sent (or, ``send=False``, skipped).

        Yields a :class:`Fired` if this beat won the due time, None if another beat
        sent it first or the entry changed or was paused since it was read. While
        the block runs, every pgqueue publish of this thread goes through this
        transaction (:func:`kombu_pgqueue.transaction`): the task and the entry's new
        last due time commit together when the block ends, and an exception rolls
        both back (the due time stays unsent, for the next tick).
        """
        params = {
            "name": entry.name,
            "revision": entry.revision,
            "due": due,
            "now": now,
            "send": send,
            "late_after": late_after,
        }
        with self._using() as conn, conn.transaction():
            won = _rows(conn, self.schema, "fire_periodic", params)
            if not won:
                yield None
                return
            fired = Fired(name=entry.name, due=due, lateness=(now - due).total_seconds())
            with transactions.transaction(conn):
                yield fired
