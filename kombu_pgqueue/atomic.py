"""Atomic deliveries: the ack of a delivery as a statement of the application's transaction.

A consumer that does its work in the broker's database can make that work and its ack
one commit: inside its own transaction it deletes the delivery's message row, fenced by
the delivery's lease as every ack is, then commits. If the delete finds no row, the
lease was lost (it ended, and another delivery holds the message): the consumer rolls
back, and its writes vanish with the ack that would have covered them.

.. code-block:: python

    fence = Fence.from_connection(kombu_connection)
    delivery = Delivery.from_properties(message.properties)
    with psycopg.connect(fence.conninfo) as conn:   # a transaction, committed at the end
        conn.execute("INSERT INTO effects ...")
        if not fence.ack(fence.enlist(conn), delivery):
            conn.rollback()                          # not ours any more: no effects

:class:`Psycopg`, :class:`SQLAlchemy` and :class:`Django` open such a transaction on a
connection of the worker's, a SQLAlchemy ``Session`` or ``Connection``, or Django's
connection; :class:`celery_pgqueue.AtomicTask` is built on all this. The worker still
acks the message the ordinary way afterwards, and that ack finds the row gone. The
consumer is told which deliveries may end so (:func:`expect`, when they are received)
and does not warn about them as late acks; in the process that committed (Celery's
threads and solo pools), :func:`committed` tells it that the ack has nothing left to
do, and it sends nothing.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from kombu.connection import Connection
from psycopg import sql

from . import _errors, _pool, _sql, codec
from ._options import Options
from ._settler import ATOMIC_TAGS
from ._sources import Django, Psycopg, PsycopgTransaction, SQLAlchemy
from .exceptions import ConfigurationError
from .transactions import Database, Enlisted, enlist

__all__ = [
    "Delivery",
    "Django",
    "Fence",
    "Psycopg",
    "SQLAlchemy",
    "Transaction",
    "TransactionSource",
    "committed",
    "expect",
    "forget",
    "take",
]


#: what to do about an atomic task's connection to another database
_POINT_IT = (
    "Point it at the broker's database: the task's writes and its ack commit in one transaction."
)


@dataclass(frozen=True, slots=True, kw_only=True)
class Delivery:
    """One delivery of a message: its row's id and the lease that fences its ack."""

    message_id: int
    lease: int

    @property
    def tag(self) -> str:
        """Kombu's delivery tag of it."""
        return codec.delivery_tag(self.message_id, self.lease)

    @classmethod
    def from_properties(cls, properties: Mapping[str, Any] | None) -> Delivery | None:
        """The delivery of a pgqueue message's Kombu ``properties`` (Celery passes them to
        the task as ``self.request.properties``); None when they are not a pgqueue
        delivery. A message taken without ack (lease 0) is gone already: no delivery to
        fence, and :class:`ConfigurationError` says so."""
        if not properties:
            return None
        info = properties.get("delivery_info") or {}
        tag = properties.get("delivery_tag")
        if tag is None or "pgqueue_id" not in info:
            return None
        message_id, lease = codec.parse_tag(str(tag))
        if not lease:
            raise ConfigurationError(
                f"message {message_id} of queue {info.get('pgqueue_queue')!r} was taken "
                "without ack (no_ack): it left the queue when it was delivered, so there "
                "is no ack to commit with the work. Consume it with acks"
            )
        return cls(message_id=message_id, lease=lease)


# -- where the work is done: what an atomic task's self.db is ------------------------


class Transaction(Protocol):
    """One transaction of a :class:`TransactionSource`; ``handle`` is what the work
    uses (an atomic task's ``self.db``)."""

    handle: Any

    def commit(self) -> None: ...

    def rollback(self) -> None: ...

    def close(self) -> None: ...


class TransactionSource(Protocol):
    """Where an atomic consumer's transactions run (an atomic task's ``atomic_db``)."""

    #: whether its connections must be checked to reach the broker's database
    checks: bool

    def begin(self, fence: Fence) -> Transaction: ...


# -- the broker's side ----------------------------------------------------------------


class Fence:
    """Acks inside the application's transaction, for one broker schema.

    Statements go through :class:`~kombu_pgqueue.transactions.Enlisted` (the runner of
    :func:`kombu_pgqueue.transaction`), so a psycopg 3 connection, a SQLAlchemy
    ``Session`` or ``Connection`` and Django's connection all work.
    """

    def __init__(self, conninfo: str, options: Options) -> None:
        #: the broker's libpq connection string
        self.conninfo = conninfo
        self.options = options
        self._q = _sql.queries(options.schema)
        self._database: Database | None = None
        self._ack_call = (
            sql.SQL("SELECT {}.ack_delivery").format(sql.Identifier(options.schema)).as_bytes(None)
        )

    @classmethod
    def from_connection(cls, connection: Connection) -> Fence:
        """The fence of a Kombu connection's broker (Celery: ``app.connection_for_write()``)."""
        from .admin import Broker

        broker = Broker.from_connection(connection)
        return cls(broker.conninfo, broker.options)

    @property
    def schema(self) -> str:
        return self.options.schema

    def broker_database(self, *, fresh: bool = False) -> Database:
        """The broker's database and server, read once per fence (again when ``fresh``).

        On a plain connection of its own rather than the broker's pool: a process that
        only runs atomic tasks (a prefork pool child) would otherwise open a pool, and
        keep its connection, for this one statement.
        """
        if fresh or self._database is None:
            with _pool.connect(self.conninfo, self.options) as conn:
                row = conn.execute(self._q["database_identity"]).fetchone()
            if row is None:
                raise ConfigurationError("the broker's server did not say which database it is")
            self._database = Database.from_row(row)
        return self._database

    def enlist(self, conn: Any, *, check: bool = True, source: str = "") -> Enlisted:
        """Statements through ``conn``'s transaction, once ``conn`` is known to reach the
        broker's database (unless ``check`` is False: a connection opened from
        :attr:`conninfo`). Raises :class:`ConfigurationError` naming both databases, and
        ``source``, what gave ``conn`` (an atomic task's ``atomic_db``)."""
        enlisted = enlist(conn)
        if check:
            named = {"given": f"{source} gave a connection", "remedy": _POINT_IT} if source else {}
            with self._translated("database_identity"):
                identity = self._q["database_identity"]
                enlisted._check_database(self.schema, identity, self.broker_database, **named)
        return enlisted

    def ack(self, enlisted: Enlisted, delivery: Delivery) -> bool:
        """Delete ``delivery``'s row in the enlisted transaction; False when its lease
        was lost. The caller commits, or rolls back on False."""
        params = {"id": delivery.message_id, "lease": delivery.lease}
        with self._translated("ack_in_transaction"):
            return bool(enlisted.rows(self.schema, self._q["ack_in_transaction"], params))

    def settle(self, transaction: Transaction, enlisted: Enlisted, delivery: Delivery) -> bool:
        """:meth:`ack` ``delivery`` in ``transaction`` and commit it; False, rolled back,
        when its lease was lost.

        On a connection of :class:`Psycopg`, the ack and the COMMIT are one simple query,
        one round trip (function ``ack_delivery``, migration 0008): a delete that finds no
        row raises, which aborts the transaction, so the COMMIT behind it rolls back.
        """
        if not isinstance(transaction, PsycopgTransaction):
            if not self.ack(enlisted, delivery):
                return False
            transaction.commit()
            return True
        # integers only: the ids are bound here, so that the statement needs no parse
        # of parameters, and the function's plan is the session's
        query = b"%s(%d, %d)" % (
            self._ack_call,
            int(delivery.message_id),
            int(delivery.lease),
        )
        with self._translated("ack_delivery"):
            return transaction.run_and_commit(query, NO_ROW)

    def holder(self, enlisted: Enlisted, delivery: Delivery) -> str:
        """Where ``delivery``'s message is now, in words (after :meth:`ack` found nothing)."""
        params = {"id": delivery.message_id, "now": None}
        with self._translated("delivery_holder"):
            rows = enlisted.rows(self.schema, self._q["delivery_holder"], params)
        if not rows:
            return "it is gone (acked by another delivery, purged or expired)"
        leased, attempts, live = rows[0]
        if leased and live:
            return f"another delivery holds it (attempt {attempts})"
        return f"it waits for another delivery (attempt {attempts} so far)"

    def _translated(self, name: str) -> Any:
        return _errors.translated(
            name, self.schema, lambda: _pool.forget_schema(self.conninfo, self.schema)
        )


#: SQLSTATE of what ack_delivery raises when its fenced delete finds no row
NO_ROW = "P0002"  # no_data_found (psycopg.errors.NoDataFound)


# -- what the consumer is told ------------------------------------------------------------
# The registry lives in the core (the settler asks it at each ack); these are its public
# names, for the Celery side (celery_pgqueue.atomic).

#: the delivery ``tag`` goes to an atomic task: its ack may find the row gone
expect = ATOMIC_TAGS.expect
#: a task of this process committed the ack of ``tag`` (a pool child's says nothing)
committed = ATOMIC_TAGS.committed
#: what the consumer's ack of ``tag`` has to do: nothing, delete if there, or ack
take = ATOMIC_TAGS.take
#: ``tag`` was settled otherwise (rejected, released, restored)
forget = ATOMIC_TAGS.forget
