"""What monitors read from the database: one typed method per statement of
``sql/monitoring.sql``, executed by the :class:`~kombu_pgqueue._store.Store`.

Every statement here costs a bounded amount however many messages wait: counts stop
at ``cap`` and are estimated beyond it (see :class:`QueueDepth`), so a scraper may
call them every few seconds against a table of ten million rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from ._store import Store
from .schedule import Entry, Leader

#: Counts up to this many messages per queue are exact; beyond, they are estimates.
DEFAULT_CAP = 10_000


@dataclass(frozen=True, slots=True, kw_only=True)
class QueueDepth:
    """One queue's messages by state.

    ``ready`` and ``leased`` are exact while the queue holds at most ``cap`` messages
    that are not delayed (``ready_exact``); ``dead`` while it has at most ``cap`` dead
    letters (``dead_exact``); ``delayed`` while all queues together hold at most
    ``cap`` delayed messages (``delayed_exact``). Beyond that they are estimates from
    PostgreSQL's statistics: the live-row count of the table, ANALYZE's share of each
    queue, and, for delayed messages, the queues of the ``cap`` soonest due ones.
    """

    queue: str
    ready: int
    leased: int
    delayed: int
    dead: int
    ready_exact: bool
    delayed_exact: bool
    dead_exact: bool
    #: seconds since the oldest ready message was published; None when none is ready
    oldest_ready_age: float | None

    @property
    def exact(self) -> dict[str, bool]:
        """``{state: exact}`` for the four counts."""
        return {
            "ready": self.ready_exact,
            "leased": self.ready_exact,
            "delayed": self.delayed_exact,
            "dead": self.dead_exact,
        }

    @property
    def counts(self) -> dict[str, int]:
        """``{state: messages}``."""
        return {
            "ready": self.ready,
            "leased": self.leased,
            "delayed": self.delayed,
            "dead": self.dead,
        }


@dataclass(frozen=True, slots=True, kw_only=True)
class TableSize:
    """A broker table as the server's statistics see it."""

    table: str
    total_bytes: int
    live_rows: int
    dead_rows: int
    #: seconds since the last VACUUM or autovacuum; None if never vacuumed
    last_vacuum_age: float | None


@dataclass(frozen=True, slots=True, kw_only=True)
class Generation:
    """One generation of the message storage (a partition of ``message_store``)."""

    gen: int
    #: next (attached ahead), current (publishes go here), live (older, may hold
    #: messages), drained (holds none; claims skip it), emptied (truncated, not yet recycled)
    state: str
    total_bytes: int
    #: the session whose lock keeps this generation from being emptied or recycled, and
    #: for how many seconds; None when nothing waits
    blocked_by: int | None = None
    blocked_seconds: float | None = None
    #: that session's application_name (pg_dump's is "pg_dump"), where this role may see it
    blocked_by_application: str | None = None

    @property
    def waiting(self) -> bool:
        """Space that nothing live uses and a lock holder keeps."""
        return self.state in ("drained", "emptied") and self.blocked_by is not None


class Monitor:
    """Read-only queries over one store's schema, for metrics and dashboards."""

    def __init__(self, store: Store, *, cap: int = DEFAULT_CAP) -> None:
        if cap < 0:
            raise ValueError(f"cap must be at least 0, got {cap!r}")
        self.store = store
        self.cap = cap

    @property
    def schema(self) -> str:
        return self.store.schema

    def _params(self, now: datetime | None, **extra: Any) -> dict[str, Any]:
        return {"schema": self.store.schema, "now": now, **extra}

    def queue_depths(self, now: datetime | None = None) -> list[QueueDepth]:
        """Every queue with messages, dead letters or a declaration, by name."""
        rows = self.store.rows("queue_depths", self._params(now, cap=self.cap))
        return [
            QueueDepth(
                queue=row[0],
                ready=int(row[1]),
                leased=int(row[2]),
                delayed=int(row[3]),
                dead=int(row[4]),
                ready_exact=bool(row[5]),
                delayed_exact=bool(row[6]),
                dead_exact=bool(row[7]),
                oldest_ready_age=None if row[8] is None else float(row[8]),
            )
            for row in rows
        ]

    def generations(self, now: datetime | None = None) -> list[Generation]:
        """The storage's generations, oldest first, and what keeps any from going."""
        rows = self.store.rows("generations", self._params(now))
        return [
            Generation(
                gen=int(row[0]),
                state=row[1],
                total_bytes=int(row[2]),
                blocked_by=row[3],
                blocked_seconds=None if row[4] is None else float(row[4]),
                blocked_by_application=row[5] or None,
            )
            for row in rows
        ]

    def table_sizes(self, now: datetime | None = None) -> list[TableSize]:
        """The message and dead_letter tables: size, live and dead rows, last vacuum."""
        rows = self.store.rows("table_sizes", self._params(now))
        return [
            TableSize(
                table=row[0],
                total_bytes=int(row[1]),
                live_rows=int(row[2]),
                dead_rows=int(row[3]),
                last_vacuum_age=None if row[4] is None else float(row[4]),
            )
            for row in rows
        ]

    def periodic_entries(self) -> list[Entry]:
        """The periodic entries (celery_pgqueue.beat), paused ones too, with their counts."""
        rows = self.store.rows("periodic_entries", {"enabled_only": False})
        return [Entry.from_row(row) for row in rows]

    def beat_leader(self) -> Leader | None:
        """The leading beat, or None while none leads."""
        rows = self.store.rows("beat_leader", {"schema": self.store.schema})
        if not rows:
            return None
        node, pid, since = rows[0]
        return Leader(node=node, backend_pid=int(pid), since=since)
