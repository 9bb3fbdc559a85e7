"""One typed method per named statement of ``sql/queries.sql`` and ``sql/archive.sql``,
on the process's shared pool.

Statements come from ``sql/*.sql`` (see :mod:`._sql`). Each method borrows a pooled
autocommit connection for one statement (:meth:`~._connected.Connected.rows`); nothing
holds a transaction open between calls, so acks may come from any thread. Connections of
their own send the same statements: the LISTEN session (:mod:`._listener`), the loop's
claimer (:mod:`._claimer`) and the unconfirmed publisher (:mod:`._pipelined`).
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Sequence
from datetime import datetime
from typing import Any

import psycopg
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from . import _counters, _pool, _sql, transactions
from ._connected import Connected
from ._copy import load_staged
from ._handoffs import seal
from ._rotation import Policy
from .exceptions import PrivilegeError
from .records import (
    STAGING_COLUMNS,
    ClaimRequest,
    ClaimResult,
    DeadLetter,
    Delivered,
    Failure,
    Outgoing,
    QueueStats,
    Rotation,
)


def driver_version() -> str:
    return str(psycopg.__version__)


def new_lease() -> int:
    """Return a fencing token for one claim (positive, fits a bigint)."""
    return secrets.randbits(62) + 1


logger = logging.getLogger(__name__)


def publish_statement(replace: bool) -> str:
    """The statement that publishes one message: ``publish_replacing`` writes over the
    waiting message with the same dedup key, ``publish`` skips it."""
    return "publish_replacing" if replace else "publish"


class Store(Connected):
    """Typed access to one pgqueue schema: one method per named statement."""

    #: the schema's handoff key as an AESGCM (False: not readable here); see sealer
    _sealer: AESGCM | bool | None = None

    # -- publishing --------------------------------------------------------------

    def publish(self, message: Outgoing, *, replace: bool = False) -> int | None:
        """Store one message; return its id, or None when its dedup key was taken.

        With ``replace``, a waiting message with the same dedup key is overwritten.
        """
        row = self._one(publish_statement(replace), self.publish_params(message))
        return int(row[0]) if row else None

    def publish_params(self, message: Outgoing) -> dict[str, Any]:
        """Statement publish's parameters (publish_replacing's too) but what
        :meth:`Connected.fill` adds."""
        return {
            **message.params(),
            **self._handoff_params(message),
            "channel": self.options.channel,
        }

    def routed_params(self, exchange: str, routing_key: str, message: Outgoing) -> dict[str, Any]:
        """Statement publish_routed's parameters but what :meth:`Connected.fill` adds."""
        return {
            **message.params(),
            **self._handoff_params(message),
            "exchange": exchange,
            "routing_key": routing_key,
            "channel": self.options.channel,
        }

    def _handoff_params(self, message: Outgoing) -> dict[str, Any]:
        """Whether the publish may lease ``message`` to a waiting consumer, the lease it
        would take, and the message sealed for the NOTIFY (see the top of
        sql/queries.sql). Not in an application's transaction, which notifies at its
        commit and hands nothing off."""
        lease = new_lease()
        sealed = None
        if self.options.handoff and transactions.current() is None:
            box = self.sealer()
            sealed = None if box is None else seal(box, message, lease)
        return {"handoff": sealed is not None, "sealed": sealed, "lease": lease}

    def sealer(self) -> AESGCM | None:
        """What seals and opens handoffs: the schema's key (migration 0010), read once;
        None (and handoffs off, said once in the log) for a role that may not read it."""
        if self._sealer is None:
            try:
                row = self._one("handoff_key", {})
            except PrivilegeError as exc:
                logger.warning("pgqueue: handoffs off in this process: %s", exc)
                self._sealer = False
                return None
            assert row is not None
            self._sealer = AESGCM(bytes(row[0]))
        return self._sealer if isinstance(self._sealer, AESGCM) else None

    def publish_many(self, messages: Sequence[Outgoing]) -> int:
        """Store many messages in one transaction; return how many were inserted."""
        return self.publish_rows([m.row() for m in messages])

    def publish_rows(self, rows: Sequence[Sequence[Any]]) -> int:
        """Store staging rows (:data:`STAGING_COLUMNS` order) in one transaction.

        On the broker's own connections the rows go in by COPY through a staging
        table; inside an enlisted application transaction, as one INSERT. Returns how
        many were inserted (the rest had a dedup key that was taken).
        """
        if not rows:
            return 0
        if transactions.current() is None:
            with self.translated("publish_many"), self.pool.connection() as conn:
                # a bulk load may take longer than one statement should (behind a
                # transaction pooler no session setting is made: see _pool)
                direct = not _pool.pooled(self.conninfo)
                if direct:
                    conn.execute("SET statement_timeout = 0")
                try:
                    return load_staged(
                        conn, self.options.schema, self.options.channel, rows, gate=True
                    )
                finally:
                    if direct and not conn.closed:
                        conn.execute(_pool.statement_timeout(self.options))
        columns: dict[str, list[Any]] = {name: [] for name, _ in STAGING_COLUMNS}
        for row in rows:
            for (name, _), value in zip(STAGING_COLUMNS, row):
                columns[name].append(value)
        found = self.rows("publish_many", {**columns, "channel": self.options.channel})
        return int(found[0][0]) if found else 0

    def publish_routed(
        self, exchange: str, routing_key: str, message: Outgoing
    ) -> list[str] | None:
        """Route through the shared bindings of ``exchange``; return the queues reached
        (not those where the message's dedup key was taken), None when no binding
        matched (the message is unroutable)."""
        rows = self.rows("publish_routed", self.routed_params(exchange, routing_key, message))
        if rows and rows[0][0] is None:
            return None
        return [row[0] for row in rows]

    # -- consuming ---------------------------------------------------------------

    def claim(
        self,
        queue: str,
        limit: int,
        lease: int,
        now: datetime | None = None,
        after: tuple[int, int] | None = None,
        above: bool = False,
    ) -> list[Delivered]:
        """Lease up to ``limit`` ready messages, from the head of the queue.

        ``after`` = (priority, id) claims only messages of that priority with a larger
        id (statement ``claim_after``): the index scan starts right there. With
        ``above``, only messages of a higher priority than ``after``'s, from the head of
        their range (statement ``claim_above``).
        """
        return self.run_claim(self.claim_request(queue, limit, lease, now, after, above)).rows

    def run_claim(self, request: ClaimRequest) -> ClaimResult:
        """Run a claim here and wait for it (the claimer sends the same without waiting);
        what it moved to the dead letters instead is the result's ``buried``."""
        result = ClaimResult.from_rows(request, self.rows(request.statement, dict(request.params)))
        _counters.claimed(request.queue, result.rows)
        return result

    def claim_request(
        self,
        queue: str,
        limit: int,
        lease: int,
        now: datetime | None = None,
        after: tuple[int, int] | None = None,
        above: bool = False,
    ) -> ClaimRequest:
        """A claim of up to ``limit`` messages, leased by ``lease``, ready to run (here,
        or without waiting by the loop's claimer)."""
        if after is None:
            statement, above = "claim", False
        else:
            statement = "claim_above" if above else "claim_after"
        params = {
            "queue": queue,
            "limit": limit,
            "lease": lease,
            "lease_seconds": self.options.visibility_timeout,
            "max_attempts": self.options.claim_attempt_limit,
            "now": now,
            "after_priority": None if after is None else after[0],
            "after_id": None if after is None else after[1],
        }
        self.fill(statement, params)
        return ClaimRequest(queue, limit, lease, statement, params, after, above)

    def positional(self, name: str) -> tuple[bytes, tuple[str, ...]]:
        """Statement ``name`` with ``$n`` placeholders, and the parameter name of each n.

        For libpq's own calls (the loop claimer sends claims without waiting for them).
        """
        return _sql.positional(self.schema, name)

    def take(self, queue: str, limit: int, now: datetime | None = None) -> list[Delivered]:
        rows = self.rows("take", {"queue": queue, "limit": limit, "now": now})
        rows.sort(key=lambda row: (-row[1], row[0]))
        return [Delivered(*row) for row in rows]

    def ack(self, id: int, lease: int) -> bool:
        return self._one("ack", {"id": id, "lease": lease}) is not None

    def ack_many(self, ids: Sequence[int], leases: Sequence[int]) -> int:
        return len(self.rows("ack_many", {"ids": list(ids), "leases": list(leases)}))

    def requeue(self, id: int, lease: int, now: datetime | None = None) -> bool:
        params = {"id": id, "lease": lease, "channel": self.options.channel, "now": now}
        return self._one("requeue", params) is not None

    def release(
        self,
        ids: Sequence[int],
        leases: Sequence[int],
        now: datetime | None = None,
        *,
        uncount: bool = True,
    ) -> None:
        """Hand back leased messages; ``uncount``: they never reached a callback, so
        this delivery does not count against max_attempts."""
        if ids:
            params = {"ids": list(ids), "leases": list(leases), "channel": self.options.channel}
            self.rows("release", {**params, "now": now, "uncount": uncount})

    def bury(self, id: int, lease: int, reason: str, error: str | None = None) -> bool:
        params = {"id": id, "lease": lease, "reason": reason, "error": error}
        return self._one("bury", params) is not None

    def renew(
        self, ids: Sequence[int], leases: Sequence[int], now: datetime | None = None
    ) -> set[int]:
        if not ids:
            return set()
        params = {
            "ids": list(ids),
            "leases": list(leases),
            "lease_seconds": self.options.visibility_timeout,
            "now": now,
        }
        return {row[0] for row in self.rows("renew", params)}

    def poll(
        self,
        queues: Sequence[str],
        now: datetime | None = None,
        check: Sequence[str] | None = None,
    ) -> tuple[set[str], float | None]:
        """Promote due delayed messages; return (queues with ready messages, next due epoch).

        ``queues`` are kept alive (x-expires); only ``check`` (default: all of them) are
        looked at for ready messages: each look walks the queue's head, which under a
        long-open snapshot elsewhere steps over every message acked since it began.
        """
        check = list(queues) if check is None else list(check)
        rows = self.rows(
            "poll",
            {"queues": list(queues), "check": check, "now": now, "channel": self.options.channel},
        )
        ready = {row[0] for row in rows if row[0] is not None}
        due = [row[1] for row in rows if row[1] is not None]
        return ready & set(queues), (min(due) if due else None)

    def sweep(self, now: datetime | None = None, min_expires: float = 30.0) -> dict[str, int]:
        row = self._one("sweep", {"now": now, "min_expires": min_expires})
        keys = ("expired_messages", "expired_queues", "bindings", "queue_messages")
        return dict(zip(keys, (int(v) for v in row))) if row else {}

    def rotate_step(self, step: str, policy: Policy) -> Rotation:
        """One step of the storage's rotation (function ``rotate``, which runs
        ``rotate_<step>``, migration 0016), a transaction of its own; it returns at once
        when another process is taking one. :mod:`._rotation` takes them in turn."""
        params = {
            "step": step,
            "channel": self.options.channel,
            "max_age": policy.max_age,
            "min_age": policy.min_age,
            "dead_limit": policy.dead_limit,
            "batch": policy.batch,
            "max_generations": policy.max_generations,
        }
        row = self._one("rotate_step", params)
        return Rotation(*row) if row else Rotation(False, 0, 0, 0)

    # -- queues, exchanges, bindings ---------------------------------------------

    def declare_queue(
        self,
        queue: str,
        *,
        expires: float | None = None,
        message_ttl: float | None = None,
        max_priority: int | None = None,
    ) -> None:
        self.rows(
            "declare_queue",
            {
                "queue": queue,
                "expires": expires,
                "message_ttl": message_ttl,
                "max_priority": max_priority,
            },
        )

    def queue_exists(self, queue: str) -> bool:
        row = self._one("queue_exists", {"queue": queue})
        return bool(row and row[0])

    def delete_queue(
        self, queue: str, *, if_unused: bool = False, now: datetime | None = None
    ) -> int | None:
        channel = self.options.channel
        params = {"queue": queue, "if_unused": if_unused, "now": now, "channel": channel}
        row = self._one("delete_queue", params)
        if row is None:
            return 0
        return None if row[0] is None else int(row[0])

    def size(self, queue: str, now: datetime | None = None) -> int:
        row = self._one("size", {"queue": queue, "now": now})
        return int(row[0]) if row else 0

    def purge(self, queue: str, now: datetime | None = None) -> int:
        row = self._one("purge", {"queue": queue, "now": now})
        return int(row[0]) if row else 0

    def declare_exchange(self, exchange: str, type: str) -> None:
        self.rows("declare_exchange", {"exchange": exchange, "type": type})

    def exchange_type(self, exchange: str) -> str | None:
        row = self._one("exchange_type", {"exchange": exchange})
        return str(row[0]) if row else None

    def delete_exchange(self, exchange: str) -> None:
        self.rows("delete_exchange", {"exchange": exchange})

    def bind(self, exchange: str, routing_key: str, queue: str, pattern: str | None) -> None:
        self.rows(
            "bind",
            {"exchange": exchange, "routing_key": routing_key, "queue": queue, "pattern": pattern},
        )

    def unbind(self, exchange: str, routing_key: str, queue: str) -> None:
        self.rows("unbind", {"exchange": exchange, "routing_key": routing_key, "queue": queue})

    def bindings(self, exchange: str) -> list[tuple[str, str | None, str]]:
        return [(r[0], r[1], r[2]) for r in self.rows("bindings", {"exchange": exchange})]

    def queue_stats(self) -> list[QueueStats]:
        return [QueueStats(*row) for row in self.rows("queue_stats", {})]

    # -- dead letters --------------------------------------------------------------

    def dead_letters(self, queue: str | None = None, limit: int = 100) -> list[DeadLetter]:
        rows = self.rows("dead_letters", {"queue": queue, "limit": limit})
        return [DeadLetter(*row) for row in rows]

    def dead_letter(self, id: int) -> DeadLetter | None:
        row = self._one("dead_letter", {"id": id})
        return DeadLetter(*row) if row else None

    def requeue_dead(self, ids: Sequence[int]) -> list[str]:
        params = {"ids": list(ids), "channel": self.options.channel}
        return [row[0] for row in self.rows("requeue_dead", params)]

    def purge_dead(self, queue: str | None = None) -> int:
        row = self._one("purge_dead", {"queue": queue})
        return int(row[0]) if row else 0

    # -- failed tasks and dead letters by reason and age (sql/archive.sql) ---------

    def bury_failed(self, failure: Failure) -> int | None:
        """Keep a task that failed for good as a dead letter (reason failed); its id,
        or None when another delivery holds the message (it runs again there)."""
        row = self._one("bury_failed", failure.params())
        return int(row[0]) if row else None

    def dead_letters_where(
        self, queue: str | None, reason: str | None, limit: int
    ) -> list[DeadLetter]:
        params = {"queue": queue, "reason": reason, "limit": limit}
        return [DeadLetter(*row) for row in self.rows("dead_letters_where", params)]

    def dead_letter_full(self, id: int) -> DeadLetter | None:
        row = self._one("dead_letter_full", {"id": id})
        return DeadLetter(*row) if row else None

    def purge_dead_where(
        self,
        queue: str | None,
        reason: str | None,
        older_than: float | None,
        now: datetime | None = None,
    ) -> int:
        params = {"queue": queue, "reason": reason, "older_than": older_than, "now": now}
        row = self._one("purge_dead_where", params)
        return int(row[0]) if row else 0
