"""pgqueue transport: PostgreSQL as a Kombu/Celery broker.

Features
========
* Type: Virtual
* Supports Direct: Yes
* Supports Topic: Yes
* Supports Fanout: Yes (bindings are rows, so every process routes alike)
* Supports Priority: Yes (AMQP order: higher first, 0-255)
* Supports TTL: Yes (``expiration``, ``x-message-ttl``, ``x-expires``)
* Supports native delayed delivery: Yes (Celery ``eta``/``countdown``)
* Evented: Yes (LISTEN/NOTIFY socket registered with the event loop)

Messages are rows. A consumer claims a batch with one ``FOR UPDATE SKIP LOCKED``
statement that also leases the rows (``visibility_timeout``) and counts the
attempt. Ack deletes the row, fenced by the lease. A live consumer renews its
leases; a dead one's messages come back when the lease ends. A message delivered
``max_attempts`` times without an ack moves to the ``dead_letter`` table.

Connection string
=================
.. code-block::

    pgqueue://USER:PASSWORD@HOST:PORT/DBNAME
    pgqueue://USER@%2Fvar%2Frun%2Fpostgresql/DBNAME      (Unix socket directory)
    pgqueue+postgresql://USER@HOST/DBNAME?sslmode=require (any libpq URL after the +)
    pgqueue://db1:5432/db;pgqueue://db2:5432/db           (failover list)

In a failover list give every URL its port: Kombu's ``Connection.switch()`` keeps
the previous URL's port when the next URL names none.

Kombu rejects unknown query parameters on ``pgqueue://`` URLs, so libpq options
(``sslmode``, ``application_name``, ``target_session_attrs``, ...) go in the
transport options or after ``pgqueue+``. Apps that cannot import
``kombu_pgqueue`` before connecting set
``broker_transport = "kombu_pgqueue.transport:Transport"``.

Transport options
=================
* ``schema`` (str, ``"pgqueue"``): schema holding the broker's tables.
* ``visibility_timeout`` (float, 60): lease length in seconds. A dead consumer's
  messages come back after this long; a live one renews before it runs out.
* ``lease_renewal_interval`` (float, visibility_timeout / 3): seconds between renewals.
* ``max_attempts`` (int, 5): deliveries without an ack before a message is moved to
  the dead letters. 0 turns the limit off.
* ``polling_interval`` (float, 5.0): seconds between safety polls, which catch what a
  lost notification missed and keep expiring queues alive. With LISTEN off this is
  the delivery latency.
* ``batch_acks`` (bool, True): acks are deleted by a background thread, everything
  acked since its last statement in one statement (as AMQP acks, they are not
  confirmed; a process killed right after ``ack()`` gets the message redelivered).
  False deletes each row before ``ack()`` returns.
* ``async_claims`` (bool, True): a consumer in an event loop (a Celery worker) sends
  its claims on a connection of its own without waiting for them (the socket is a
  reader of the loop), so the loop goes on dispatching tasks and reading results while
  a claim is in the database. False claims in the loop's own thread, waiting; then a
  task claimed by the loop's tick callback (the first safety poll after a reconnect, a
  window that opened again) can wait in a prefork pool until the loop's next wakeup.
  ``claim_thread`` is its former name (claims ran on a helper thread then).
* ``dedup_task_ids`` (bool, True): when Kombu retries a publish of a Celery task
  message (its connection broke after the commit may have reached the server), the
  retry is not queued again while the first copy waits or runs: each publish call is
  keyed by the task id and an id of the call. Only retries of one call are dropped: a
  task id sent again on purpose (``Task.replace``, chord bodies, ``Task.retry``,
  ``apply_async(task_id=...)`` twice) is always queued. Any message may
  also carry its own key: ``properties["dedup_key"]`` or ``headers["dedup_key"]``
  (Celery: ``apply_async(..., dedup_key="...")``); with ``dedup_replace=True`` a
  waiting message with that key is replaced instead.
* ``relax_consumer_commits`` (bool, True): claims, acks, renewals and releases commit
  without waiting for the WAL flush (each statement sets ``synchronous_commit`` to off
  for its own commit, with ``set_config(..., true)``). A database crash can forget the
  last of them, which only causes a redelivery. Publishes wait for the flush unless
  the ``synchronous_commit`` option says otherwise.
* ``sweep_interval`` (float, 30): seconds between removals of expired messages
  and unused ``x-expires`` queues.
* ``listen`` (bool, True): wait on LISTEN/NOTIFY. Turn off behind PgBouncer in
  transaction mode (then also set ``prepare_threshold`` to None).
* ``auto_migrate`` (bool, True): install or upgrade the schema on first connect.
  When off, a missing or old schema raises :class:`~kombu_pgqueue.SchemaError`
  naming ``python -m kombu_pgqueue migrate``.
* ``pool_max_size`` (int, 8): pooled connections per process and database.
* ``pool_timeout`` (float, 30): seconds to wait for a pooled connection.
* ``prepare_threshold`` (int or None, 5): psycopg's server-side prepare threshold.
* ``synchronous_commit`` (str, unset): PostgreSQL's ``synchronous_commit`` for the
  broker's sessions. Unset keeps the server's (durable) setting. ``"off"`` makes
  publishes several times faster on slow disks but a database crash can lose the last
  few hundred milliseconds of published messages, as Redis without AOF can. Off by
  default; benchmarked separately.
* ``libpq`` (dict, {}): extra libpq connection parameters; top-level options
  named like libpq keywords (``sslmode``, ``application_name``, ...) go there too.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import psycopg
from kombu.exceptions import ChannelError
from kombu.transport import base, virtual
from kombu.transport.virtual.base import Empty
from kombu.utils.objects import cached_property

from . import _counters, codec
from ._acks import AckBatcher
from ._claimer import Claimer
from ._leases import LeaseKeeper
from ._listener import Listener, Wakeups
from ._options import build_conninfo, check_name, parse_options, topic_pattern
from ._store import Delivered, Outgoing, Store, new_lease
from .exceptions import ConfigurationError

logger = logging.getLogger(__name__)

#: a batch size for consumers that set no prefetch limit
UNLIMITED_BATCH = 100

#: seconds a consumer that still holds messages waits for three quarters of its window
#: to free (see Channel.batch_limit)
CLAIM_BATCH_WAIT = 0.05

#: a consumer that delivered nothing for this long claims in the event loop's own
#: thread, waiting for the answer: the loop has nothing else to do meanwhile, and the
#: hops to a claim thread and back (a thread wakeup, then a pipe write and another loop
#: wakeup) came to about a tenth of the time from apply_async to task start on an idle
#: prefork worker
IDLE_INLINE_SECONDS = 0.02

#: a claim from the head that took longer than this in the server (it stepped over many
#: acked rows that VACUUM may not remove yet, e.g. while an old snapshot is held) makes
#: the consumer resume after its last message for RESUME_SECONDS, or 20 times that
#: claim's duration if longer; then it claims from the head again, which also picks up
#: requeued messages, lease expiries and higher priorities (they wait that long at most,
#: plus a safety poll if nothing else wakes the consumer, and only while the head is
#: slow). The server's time, not the client's: an asynchronous claim's answer may wait
#: in its socket while the event loop is busy, and that says nothing about the head.
SLOW_CLAIM_SECONDS = 0.005
RESUME_SECONDS = 1.0


@dataclass(slots=True)
class ClaimJob:
    """One claim, decided by :meth:`Channel.claim_job` before it is sent."""

    queue: str
    limit: int
    lease: int
    #: (priority, id, until): the claim resumes after that message (statement claim_after)
    resume: tuple[int, int, float] | None
    statement: str
    params: dict[str, Any]


def _cancel(timer: Any) -> None:
    if timer is not None:
        try:
            timer.cancel()
        except Exception:  # noqa: S110 - a timer the loop already dropped
            pass


class QoS(virtual.QoS):
    """Prefetch accounting over leases: ack, reject and restore go to the database."""

    def held(self) -> list[tuple[int, int]]:
        """(id, lease) of every message this channel holds unacked."""
        for _ in range(5):
            try:
                tags = [tag for tag in list(self._delivered) if tag not in self._dirty]
                return [codec.parse_tag(tag) for tag in tags]
            except RuntimeError:  # the consuming thread changed the dict meanwhile
                continue
        return []

    def unacked(self) -> int:
        return len(self._delivered) - len(self._dirty)

    def ack(self, delivery_tag: str) -> None:
        message_id, lease = codec.parse_tag(delivery_tag)
        _counters.add("acked")
        # a channel closed by a reconnect (the database restarted) has no connection,
        # but a task that finishes afterwards still acks through it: send that ack
        # directly, and if the database cannot take it, the lease runs out and the
        # message is delivered again (at-least-once), never a crashed worker
        transport = self.channel.connection
        acks = transport.acks if transport is not None else None
        if acks is not None:
            acks.add(message_id, lease)
        else:
            try:
                done = self.channel.store.ack(message_id, lease)
            except psycopg.Error as exc:
                logger.warning(
                    "pgqueue: ack of message %s failed (%r); it runs again when its lease ends",
                    message_id,
                    exc,
                )
                done = True
            if not done:
                logger.warning(
                    "pgqueue: ack of message %s came after its lease ended; it may run again",
                    message_id,
                )
        super().ack(delivery_tag)

    def reject(self, delivery_tag: str, requeue: bool = False) -> None:
        message_id, lease = codec.parse_tag(delivery_tag)
        if requeue:
            self.channel.store.requeue(message_id, lease)
            _counters.add("requeued")
        else:
            self.channel.store.bury(message_id, lease, "rejected")
            _counters.add("rejected")
        self._quick_ack(delivery_tag)

    def restore_unacked(self) -> list[Any]:
        """Hand back every held message at once; they are redelivered immediately."""
        self.channel.connection.flush_acks()
        self._flush()
        held = self.held()
        self._delivered.clear()
        if held:
            try:
                self.channel.store.release([i for i, _ in held], [lease for _, lease in held])
            except Exception as exc:  # best effort: the leases lapse by themselves
                logger.warning(
                    "pgqueue: could not release %d messages (%r); they return when "
                    "their leases end",
                    len(held),
                    exc,
                )
        return []


class Channel(virtual.Channel):
    QoS = QoS
    supports_fanout = True
    # bodies are stored as bytea; no base64 on the way
    body_encoding = None
    max_priority = 255
    # routing is done in SQL, so Kombu's unroutable-message queue has no hook here
    from_transport_options = ()

    def __init__(self, connection: Transport, **kwargs: Any) -> None:
        super().__init__(connection, **kwargs)
        self.store: Store = connection.store
        # kept here: Kombu clears channel.connection when the channel closes
        self._task_keys: codec.TaskKeys = (
            "publish" if connection.options.dedup_task_ids else None
        )
        self._noack_queues: set[str] = set()
        self._last_claim = 0.0
        #: messages that claims in flight (see _claimer) may still bring
        self._claiming = 0
        #: queue -> (priority, id, until): where this channel resumes claiming, see _claim
        self._resume: dict[str, tuple[int, int, float]] = {}

    # -- declarations ----------------------------------------------------------

    def prepare_queue_arguments(self, arguments: Any, **kwargs: Any) -> Any:
        return base.to_rabbitmq_queue_arguments(arguments, **kwargs)

    def _new_queue(self, queue: str, **kwargs: Any) -> None:
        check_name("queue", queue)
        arguments = kwargs.get("arguments") or {}
        self.store.declare_queue(
            queue,
            expires=codec.seconds(arguments.get("x-expires")),
            message_ttl=codec.seconds(arguments.get("x-message-ttl")),
            max_priority=arguments.get("x-max-priority"),
        )

    def _has_queue(self, queue: str, **kwargs: Any) -> bool:
        return self.store.queue_exists(queue)

    def queue_delete(
        self, queue: str, if_unused: bool = False, if_empty: bool = False, **kwargs: Any
    ) -> int | None:
        if if_empty and self._size(queue):
            return None
        deleted = self.store.delete_queue(queue)
        self.state.queue_bindings_delete(queue)
        return deleted

    def _delete(self, queue: str, *args: Any, **kwargs: Any) -> None:
        self.store.delete_queue(queue)

    def _size(self, queue: str) -> int:
        self.connection.flush_acks()
        return self.store.size(queue)

    def _purge(self, queue: str) -> int:
        self.connection.flush_acks()
        return self.store.purge(queue)

    def exchange_declare(
        self,
        exchange: str | None = None,
        type: str = "direct",
        durable: bool = False,
        auto_delete: bool = False,
        arguments: Any = None,
        nowait: bool = False,
        passive: bool = False,
    ) -> None:
        if exchange is None:
            return
        check_name("exchange", exchange)
        if passive:
            if self._exchange_type(exchange) is None:
                raise ChannelError(
                    f"NOT_FOUND - no exchange {exchange!r}",
                    (50, 10),
                    "Channel.exchange_declare",
                    "404",
                )
            return
        if type not in self.exchange_types:
            raise ConfigurationError(
                f"exchange {exchange!r}: type {type!r} is not supported by pgqueue "
                f"(supported: {', '.join(sorted(self.exchange_types))})"
            )
        super().exchange_declare(exchange, type, durable, auto_delete, arguments, nowait)
        self.store.declare_exchange(exchange, type)

    def _exchange_type(self, exchange: str) -> str | None:
        try:
            return str(self.state.exchanges[exchange]["type"])
        except KeyError:
            return self.store.exchange_type(exchange)

    def typeof(self, exchange: str, default: str = "direct") -> Any:
        # an exchange declared by another process is known from the table
        return self.exchange_types[self._exchange_type(exchange) or default]

    def exchange_delete(self, exchange: str, if_unused: bool = False, nowait: bool = False) -> None:
        self.store.delete_exchange(exchange)
        self.state.exchanges.pop(exchange, None)

    def queue_bind(
        self,
        queue: str,
        exchange: str | None = None,
        routing_key: str = "",
        arguments: Any = None,
        **kwargs: Any,
    ) -> Any:
        if exchange and self.typeof(exchange).type == "topic":
            topic_pattern(routing_key or "")  # refused before Kombu records the binding
        return super().queue_bind(queue, exchange, routing_key, arguments, **kwargs)

    def _queue_bind(self, exchange: str, routing_key: str, pattern: Any, queue: str) -> None:
        check_name("routing key", routing_key or "")
        if pattern is not None and self.typeof(exchange).type == "topic":
            # routed in SQL, so the pattern must match in PostgreSQL as Kombu's does in re
            pattern = topic_pattern(routing_key or "")
        self.store.bind(exchange, routing_key or "", queue, pattern)

    def queue_unbind(
        self,
        queue: str,
        exchange: str | None = None,
        routing_key: str = "",
        arguments: Any = None,
        **kwargs: Any,
    ) -> None:
        if exchange:
            self.store.unbind(exchange, routing_key or "", queue)
        try:
            super().queue_unbind(queue, exchange, routing_key, arguments, **kwargs)
        except KeyError:
            pass

    def get_table(self, exchange: str) -> list[tuple[str, Any, str]]:
        return self.store.bindings(exchange)

    # -- publishing ----------------------------------------------------------------

    def _outgoing(self, queue: str, message: dict[str, Any]) -> Outgoing:
        return codec.outgoing(queue, message, task_keys=self._task_keys)

    def basic_publish(
        self, message: dict[str, Any], exchange: str, routing_key: str, **kwargs: Any
    ) -> None:
        self._inplace_augment_message(message, exchange, routing_key)
        if exchange:
            check_name("exchange", exchange)
            check_name("routing key", routing_key or "")
            self.store.publish_routed(exchange, routing_key or "", self._outgoing("", message))
        else:
            self._put(routing_key, message)

    def publish_many(self, messages: list[dict[str, Any]], routing_key: str) -> int:
        """Store many prepared messages for queue ``routing_key`` in one round trip."""
        check_name("queue", routing_key)
        outgoing = []
        for message in messages:
            self._inplace_augment_message(message, "", routing_key)
            outgoing.append(self._outgoing(routing_key, message))
        return self.store.publish_many(outgoing)

    def _put(self, queue: str, message: dict[str, Any], **kwargs: Any) -> None:
        check_name("queue", queue)
        if not queue:
            raise ConfigurationError("cannot publish to the default exchange without a queue name")
        outgoing = self._outgoing(queue, message)
        replace = bool(
            message.get("properties", {}).get("dedup_replace")
            or (message.get("headers") or {}).get("dedup_replace")
        )
        if self.store.publish(outgoing, replace=replace) is None:
            logger.info(
                "pgqueue: skipped a message for queue %r: dedup key %r is waiting or running",
                queue,
                outgoing.dedup_key,
            )

    # -- consuming -----------------------------------------------------------------

    def basic_consume(
        self, queue: str, no_ack: bool, callback: Any, consumer_tag: str, **kwargs: Any
    ) -> Any:
        check_name("queue", queue)
        if no_ack:
            self._noack_queues.add(queue)
        else:
            self._noack_queues.discard(queue)
        result = super().basic_consume(queue, no_ack, callback, consumer_tag, **kwargs)
        self.connection.on_consume(self, queue)
        return result

    def basic_cancel(self, consumer_tag: str) -> Any:
        queue = self._tag_to_queue.get(consumer_tag)
        result = super().basic_cancel(consumer_tag)
        if queue is not None and queue not in self._active_queues:
            self._noack_queues.discard(queue)
            self.connection.on_cancel(self, queue)
        return result

    def batch_limit(self) -> int:
        """How many messages this channel should claim now (0: not yet).

        Within the prefetch window, but not one slot at a time: while the channel
        still holds more than a quarter of its window (and more than one message), it
        waits (CLAIM_BATCH_WAIT at most), so a worker refills in batches instead of
        paying a claim per task. A quarter, not half: a Celery prefork -c 2 worker
        (window 8) then claims 6 at a time instead of 4, and its main process, which
        bounds the drain rate, spent 269 instead of 318 us per no-op task
        (benchmarks/probes/drain_cpu.py); what it still holds keeps the pool busy
        meanwhile.
        """
        if not self.qos.can_consume():
            return 0
        estimate = self.qos.can_consume_max_estimate()
        if estimate is None:
            return UNLIMITED_BATCH
        estimate -= self._claiming
        if estimate <= 0:
            return 0
        window = self.qos.prefetch_count
        holding = window - estimate
        if holding > max(1, window // 4) and time.monotonic() - self._last_claim < CLAIM_BATCH_WAIT:
            return 0
        return int(estimate)

    def fetch(self, queue: str, limit: int) -> list[dict[str, Any]]:
        """Claim up to ``limit`` messages of ``queue`` as Kombu payloads."""
        # no flush of pending acks first: an acked message still holds its lease until
        # the ack thread deletes it, so a claim cannot hand it out meanwhile
        if queue in self._noack_queues:
            self._last_claim = time.monotonic()
            return [codec.payload(row, queue, 0) for row in self.store.take(queue, limit)]
        job = self.claim_job(queue, limit)
        return self.claimed(job, *self.store.claim_with(job.statement, job.params))

    def claim_job(self, queue: str, limit: int) -> ClaimJob:
        """Decide how to claim from ``queue`` now: from its head, or after this channel's
        last message there (see :meth:`claimed`)."""
        now = self._last_claim = time.monotonic()
        resume = self._resume.get(queue)
        if resume is not None and now >= resume[2]:
            resume = None
        lease = new_lease()
        after = None if resume is None else resume[:2]
        statement, params = self.store.claim_params(queue, limit, lease, after=after)
        return ClaimJob(queue, limit, lease, resume, statement, params)

    def claimed(self, job: ClaimJob, rows: list[Delivered], took: float) -> list[dict[str, Any]]:
        """The payloads of what ``job`` claimed; the statement took ``took`` seconds in
        the server."""
        queue = job.queue
        if job.resume is None:
            if rows and took > SLOW_CLAIM_SECONDS:
                # the slower the head, the longer until the next look at it (at most
                # about 5 % of the time goes to claims from the head)
                until = time.monotonic() + max(RESUME_SECONDS, 20 * took)
                self._resume[queue] = (rows[-1].priority, rows[-1].id, until)
            else:
                self._resume.pop(queue, None)
        elif rows:
            self._resume[queue] = (rows[-1].priority, rows[-1].id, job.resume[2])
        # A short range means this consumer caught up with the producers; it does not go
        # back to the head for the rest (that would cost a slow head walk per wakeup, as
        # often as messages arrive): requeued and older messages wait for the period.
        if rows:
            _counters.add("claimed", queue, len(rows))
            _counters.add("redelivered", queue, sum(row.attempts > 1 for row in rows))
        lease = job.lease
        return [codec.payload(row, queue, lease) for row in rows]

    def _get(self, queue: str, timeout: float | None = None) -> dict[str, Any]:
        rows = self.fetch(queue, 1)
        if not rows:
            raise Empty()
        return rows[0]

    def basic_get(self, queue: str, no_ack: bool = False, **kwargs: Any) -> Any:
        check_name("queue", queue)
        if no_ack:
            rows = [codec.payload(row, queue, 0) for row in self.store.take(queue, 1)]
        else:
            rows = self.fetch(queue, 1)
        if not rows:
            return None
        message = self.Message(rows[0], channel=self)
        if not no_ack:
            self.qos.append(message, message.delivery_tag)
            self.connection.keep_leases()
        return message


class Transport(virtual.Transport):
    Channel = Channel

    default_port = 5432
    driver_type = "pgqueue"
    driver_name = "psycopg"
    polling_interval = 5.0

    implements = virtual.Transport.implements.extend(
        asynchronous=True,
        exchange_type=frozenset(["direct", "topic", "fanout"]),
        heartbeats=False,
    )

    connection_errors = virtual.Transport.connection_errors + (
        psycopg.OperationalError,
        psycopg.InterfaceError,
    )

    def __init__(self, client: Any, **kwargs: Any) -> None:
        self.options = parse_options(client.transport_options)
        super().__init__(client, **kwargs)
        self.polling_interval = self.options.polling_interval
        self.store = Store(self._conninfo(), self.options)
        self._listener: Listener | None = None
        self._keeper = LeaseKeeper(self.store, self._held, self.options.renewal_interval)
        self.acks: AckBatcher | None = AckBatcher(self.store) if self.options.batch_acks else None
        self._owner: dict[str, Channel] = {}
        self._pending: set[str] = set()
        self._claimer: Claimer | None = None
        #: queues with a claim in flight, and those woken meanwhile
        self._inflight: set[str] = set()
        self._last_delivery = 0.0
        self._renotified: set[str] = set()
        self._next_due: float | None = None
        self._next_poll = 0.0
        self._next_sweep = 0.0
        self._loop: Any = None
        self._loop_fd: int | None = None
        self._timers: list[Any] = []
        self._due_timer: Any = None
        self._retry_timer: Any = None
        self._retry_armed = False

    def driver_version(self) -> str:
        return str(psycopg.__version__)

    def _conninfo(self) -> str:
        client = self.client
        return build_conninfo(
            hostname=client.hostname,
            port=client.port,
            userid=client.userid,
            password=client.password,
            virtual_host=client.virtual_host,
            connect_timeout=client.connect_timeout,
            libpq=self.options.libpq,
        )

    # -- connection lifecycle --------------------------------------------------

    def establish_connection(self) -> Any:
        conninfo = self._conninfo()
        if conninfo != self.store.conninfo:  # failover switched hosts
            self.store = Store(conninfo, self.options)
            self._keeper.store = self.store
            if self.acks is not None:
                self.acks.store = self.store
        self.store.open()
        self.store.check_pool()
        return super().establish_connection()

    def close_connection(self, connection: Any) -> None:
        try:
            super().close_connection(connection)
        finally:
            if self.acks is not None:
                self.acks.stop()
            self._keeper.stop()
            self._unregister()
            if self._listener is not None:
                self._listener.close()
                self._listener = None
            self._pending.clear()

    def _ensure_listener(self) -> Listener | None:
        if not self.options.listen:
            return None
        if self._listener is None:
            self._listener = Listener(self.store.conninfo, self.options)
        self._listener.open()
        return self._listener

    # -- bookkeeping shared by both delivery modes ---------------------------------

    def on_consume(self, channel: Channel, queue: str) -> None:
        self._owner[queue] = channel
        self._pending.add(queue)
        self._ensure_listener()
        self.keep_leases()

    def on_cancel(self, channel: Channel, queue: str) -> None:
        if self._owner.get(queue) is channel:
            del self._owner[queue]
        self._pending.discard(queue)

    def flush_acks(self) -> None:
        """Send pending acks now, so what this transport reads next reflects them."""
        if self.acks is not None:
            self.acks.flush()

    def keep_leases(self) -> None:
        self._keeper.start()

    def _held(self) -> list[tuple[int, int]]:
        held: list[tuple[int, int]] = []
        for channel in list(self.channels):
            if channel._qos is not None:
                held.extend(channel._qos.held())
        return held

    def _wake(self, wake: Wakeups) -> None:
        woken = [q for q in wake.queues if q in self._owner]
        self._pending.update(woken)
        self._renotified.update(q for q in woken if q in self._inflight)
        if wake.due is not None:
            self._schedule_due(wake.due)

    def _deliver_pending(self, inline: bool = False, in_tick: bool = False) -> int:
        """Claim from every queue with news, within each channel's prefetch window.

        In an event loop with asynchronous claims, this only sends the claims (see
        :meth:`_on_claimed`), except for no-ack queues (a take deletes what it hands
        out, so it must be delivered at once), when ``inline``, and when nothing was
        delivered for IDLE_INLINE_SECONDS (the loop is idle: the claim is quicker here)
        unless called from the loop's tick callbacks (``in_tick``): Celery's prefork
        pool schedules the writes of the tasks handed to it in a tick callback of its
        own, and a task handed over in a tick callback that runs after it waits for the
        next tick, which comes after a poll that can sleep until the next timer (2 to 5
        s in the chaos listenkill scenario). The claim's answer comes back on a readable
        socket instead, and tasks delivered from a reader are written at once.
        """
        delivered = 0
        for queue in list(self._pending):
            channel = self._owner.get(queue)
            if channel is None or queue not in self._callbacks:
                self._pending.discard(queue)
                continue
            if queue in self._inflight:
                continue
            limit = channel.batch_limit()
            if not limit:
                continue  # stays pending until the window opens
            if (
                self._claimer is not None
                and not inline
                and queue not in channel._noack_queues
                and (in_tick or not self._idle(channel))
            ):
                self._claimer.submit(channel, queue, limit)
                self._inflight.add(queue)
                channel._claiming += limit
                continue
            payloads = channel.fetch(queue, limit)
            error, rest = self._hand_out(queue, limit, payloads)
            if error is not None:
                self._release_payloads(rest)
                raise error
            delivered += len(payloads)
        if self._pending and self._loop is not None and not self._retry_armed:
            # a claim put off for batching must still happen soon
            self._retry_armed = True
            self._retry_timer = self._loop.call_later(CLAIM_BATCH_WAIT, self._retry_pending)
        return delivered

    def _on_claimed(self, fileno: int | None = None) -> None:
        """Deliver what the claims in flight brought (their socket is readable)."""
        if self._claimer is None:
            return
        results = self._claimer.results()
        for channel, queue, limit, _, _ in results:
            channel._claiming = max(channel._claiming - limit, 0)
            self._inflight.discard(queue)
        error: BaseException | None = None
        undelivered: list[dict[str, Any]] = []
        for channel, queue, limit, payloads, exc in results:
            renotified = queue in self._renotified
            self._renotified.discard(queue)
            if exc is not None:
                error = error or exc  # the queue stays pending: claimed again after it
                continue
            assert payloads is not None
            if (
                error is not None
                or self._owner.get(queue) is not channel
                or (queue not in self._callbacks)
            ):
                undelivered.extend(payloads)  # cancelled meanwhile: back at once
                continue
            error, rest = self._hand_out(queue, limit, payloads, renotified)
            undelivered.extend(rest)  # and the later batches, as error is set now
        if undelivered:
            self._release_payloads(undelivered)
        if error is not None:
            raise error
        self._deliver_pending()

    def _idle(self, channel: Channel) -> bool:
        """Nothing claimed, held or delivered lately: claim in the loop's thread."""
        return (
            not self._inflight
            and channel.qos.unacked() == 0
            and time.monotonic() - self._last_delivery >= IDLE_INLINE_SECONDS
        )

    def _hand_out(
        self, queue: str, limit: int, payloads: list[dict[str, Any]], renotified: bool = False
    ) -> tuple[BaseException | None, list[dict[str, Any]]]:
        """Deliver one claim's messages; return a callback's error and what it left over.

        What was not handed out when a callback raised must be released by the caller
        at once, instead of staying leased, unseen and unrenewed, until the lease ends.
        """
        if len(payloads) < limit and not renotified:
            self._pending.discard(queue)
        if payloads:
            self._last_delivery = time.monotonic()
        for n, payload in enumerate(payloads):
            try:
                self._deliver(payload, queue)
            except BaseException as exc:
                return exc, payloads[n + 1 :]
        return None, []

    def _release_payloads(self, payloads: list[dict[str, Any]]) -> None:
        tags = [codec.parse_tag(p["properties"]["delivery_tag"]) for p in payloads]
        tags = [(i, lease) for i, lease in tags if lease]  # no-ack ones are gone already
        if not tags:
            return
        try:
            self.store.release([i for i, _ in tags], [lease for _, lease in tags])
        except Exception as exc:  # best effort: the leases lapse by themselves
            logger.warning(
                "pgqueue: could not release %d claimed messages (%r); they return when "
                "their leases end",
                len(tags),
                exc,
            )

    def _release_results(self, results: list[Any]) -> None:
        self._release_payloads([p for r in results for p in (r[3] or [])])

    def _stop_claimer(self) -> None:
        claimer, self._claimer = self._claimer, None
        if claimer is not None:
            claimer.close()
        for channel in list(self.channels):
            channel._claiming = 0
        self._inflight.clear()
        self._renotified.clear()

    def _retry_pending(self) -> None:
        self._retry_armed = False
        if self._pending:
            self._deliver_pending()

    def _poll(self) -> None:
        """The safety poll: promote due delayed messages and find ready queues.

        A queue already pending is claimed from soon anyway: looking for ready messages
        in it again would only cost a walk over its head.
        """
        owned = list(self._owner)
        ready, next_due = self.store.poll(owned, check=[q for q in owned if q not in self._pending])
        self._pending.update(ready)
        # a claim in flight may have started before these became ready
        self._renotified.update(q for q in ready if q in self._inflight)
        self._next_due = None
        if next_due is not None:
            self._schedule_due(next_due)
        now = time.monotonic()
        self._next_poll = now + self.options.polling_interval
        if now >= self._next_sweep:
            self._next_sweep = now + self.options.sweep_interval
            self.store.sweep()

    def _schedule_due(self, due: float) -> None:
        if self._next_due is not None and self._next_due <= due:
            return
        self._next_due = due
        if self._loop is not None:
            delay = max(due - time.time(), 0.0) + 0.001
            _cancel(self._due_timer)
            self._due_timer = self._loop.call_later(delay, self._on_due)

    # -- synchronous consuming -------------------------------------------------------

    def drain_events(self, connection: Any, timeout: float | None = None) -> None:
        deadline = None if timeout is None else time.monotonic() + timeout
        listener = self._ensure_listener() if self._owner else None
        while True:
            if time.monotonic() >= self._next_poll and self._owner:
                self._poll()
            if self._deliver_pending(inline=True):
                return
            now = time.monotonic()
            waits = [self._next_poll - now]
            if deadline is not None:
                waits.append(deadline - now)
            if self._next_due is not None:
                waits.append(self._next_due - time.time())
            if self._pending:
                waits.append(CLAIM_BATCH_WAIT)
            wait = max(min(waits), 0.0)
            if deadline is not None and now >= deadline:
                raise TimeoutError()
            if self._next_due is not None and self._next_due <= time.time():
                self._next_due = None
                self._next_poll = 0.0
                continue
            if listener is not None:
                self._wake(listener.wait(wait))
            else:
                time.sleep(wait)

    # -- the event loop ----------------------------------------------------------------

    def register_with_event_loop(self, connection: Any, loop: Any) -> None:
        self._unregister()
        self._loop = loop
        listener = self._ensure_listener()
        if listener is not None:
            self._loop_fd = listener.fileno()
            loop.add_reader(self._loop_fd, self._on_readable, self._loop_fd)
        if self.options.async_claims:
            self._claimer = Claimer(self.store, self._release_results)
            loop.add_reader(self._claimer.fileno(), self._on_claimed, self._claimer.fileno())
        loop.on_tick.add(self._on_tick)
        self._timers.append(loop.call_repeatedly(self.options.polling_interval, self._poll))
        self._next_poll = 0.0

    def _unregister(self) -> None:
        loop, self._loop = self._loop, None
        if loop is None:
            return
        if self._loop_fd is not None:
            try:
                loop.remove_reader(self._loop_fd)
            except (KeyError, OSError, ValueError):
                pass
            self._loop_fd = None
        if self._claimer is not None:
            try:
                loop.remove_reader(self._claimer.fileno())
            except (KeyError, OSError, ValueError):
                pass
            self._stop_claimer()
        loop.on_tick.discard(self._on_tick)
        for timer in (*self._timers, self._due_timer, self._retry_timer):
            _cancel(timer)
        self._timers.clear()
        self._due_timer = self._retry_timer = None
        self._next_due = None
        self._retry_armed = False

    def unregister_from_event_loop(self, connection: Any, loop: Any) -> None:
        self._unregister()

    def _on_readable(self, fileno: int) -> None:
        if self._listener is None:
            return
        self._wake(self._listener.drain())
        self._deliver_pending()

    def _on_tick(self) -> None:
        if self._next_poll == 0.0 and self._owner:
            self._poll()
        if self._pending:
            self._deliver_pending(in_tick=True)

    def _on_due(self) -> None:
        self._next_due = None
        self._poll()
        self._deliver_pending()

    @cached_property
    def default_connection_params(self) -> dict[str, Any]:
        return {"port": self.default_port, "hostname": None}
