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

Every transport option is documented in docs/configuration.md ("Transport options").
"""

from __future__ import annotations

import logging
from typing import Any

import kombu.exceptions
from kombu.exceptions import ChannelError
from kombu.transport import base, virtual
from kombu.transport.virtual.base import Empty  # type: ignore[attr-defined]
from kombu.utils.objects import cached_property

from . import _pipelined, codec
from ._connected import CONNECTION_ERRORS
from ._consumer import Consumer
from ._loop import LoopDriver, drain
from ._options import check_failover_list, check_name, connection_conninfo, parse_options
from ._qos import Message, QoS
from ._store import Store, driver_version
from ._topics import topic_pattern
from ._unroutable import Unroutable
from .exceptions import ConfigurationError
from .records import Delivery, Outgoing

logger = logging.getLogger(__name__)


class Channel(virtual.Channel):
    QoS = QoS
    Message = Message
    supports_fanout = True
    # bodies are stored as bytea; no base64 on the way
    body_encoding = None  # type: ignore[assignment]  # Kombu: "base64"; None means raw
    max_priority = 255
    # routing is done in SQL, so Kombu's unroutable-message queue has no hook here
    from_transport_options = ()  # type: ignore[assignment]  # Kombu names two

    def __init__(self, connection: Transport, **kwargs: Any) -> None:
        super().__init__(connection, **kwargs)  # type: ignore[no-untyped-call]
        # kept here: Kombu clears channel.connection when the channel closes
        self.consumer: Consumer = connection.consumer
        self._task_keys: codec.TaskKeys = "publish" if connection.options.dedup_task_ids else None
        self._confirm, self._unroutable = connection.options.confirm_publish, connection.unroutable

    @property
    def store(self) -> Store:
        return self.consumer.store

    # the consumer's view of this channel (kombu_pgqueue._pacing.Sink)

    def room(self) -> int | None:
        if not self.qos.can_consume():
            return 0
        estimate = self.qos.can_consume_max_estimate()
        return None if estimate is None else int(estimate)

    def window(self) -> int:
        return int(self.qos.prefetch_count or 0)

    def forget(self, tag: str) -> None:
        self.qos.forget(tag)

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
        deleted = self.store.delete_queue(queue, if_unused=if_unused)
        if deleted is not None:
            self.state.queue_bindings_delete(queue)
        return deleted

    def _delete(self, queue: str, *args: Any, **kwargs: Any) -> None:
        self.store.delete_queue(queue)

    def _size(self, queue: str) -> int:
        self.consumer.settler.flush_acks()
        return self.store.size(queue)

    def _purge(self, queue: str) -> int:
        self.consumer.settler.flush_acks()
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
        super().exchange_declare(exchange, type, durable, auto_delete, arguments, nowait)  # type: ignore[no-untyped-call]
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
        return super().queue_bind(queue, exchange, routing_key, arguments, **kwargs)  # type: ignore[no-untyped-call]

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
            super().queue_unbind(queue, exchange, routing_key, arguments, **kwargs)  # type: ignore[no-untyped-call]
        except KeyError:
            pass

    def get_table(self, exchange: str) -> list[tuple[str, Any, str]]:
        return self.store.bindings(exchange)

    # -- publishing ----------------------------------------------------------------

    def _outgoing(self, queue: str, message: dict[str, Any]) -> Outgoing:
        return codec.outgoing(queue, message, task_keys=self._task_keys)

    def _unconfirmed(self) -> _pipelined.Pipeline | None:
        """Where a publish goes that is sent without waiting for the server (option
        confirm_publish off, outside an application's transaction); None: the publish
        waits for its commit."""
        return None if self._confirm else _pipelined.unconfirmed(self.store)

    def basic_publish(
        self, message: dict[str, Any], exchange: str, routing_key: str, **kwargs: Any
    ) -> None:
        self._inplace_augment_message(message, exchange, routing_key)  # type: ignore[no-untyped-call]
        if exchange:
            check_name("exchange", exchange)
            key = check_name("routing key", routing_key or "")
            outgoing = self._outgoing("", message)
            unconfirmed = self._unconfirmed()
            if unconfirmed is not None:
                unconfirmed.publish_routed(exchange, key, outgoing, message, self._unroutable)
            elif self.store.publish_routed(exchange, key, outgoing) is None:
                self._unroutable.report(exchange, key, message)
        else:
            self._put(routing_key, message)

    def publish_many(self, messages: list[dict[str, Any]], routing_key: str) -> int:
        """Store many prepared messages for queue ``routing_key`` in one round trip."""
        check_name("queue", routing_key)
        outgoing = []
        for message in messages:
            self._inplace_augment_message(message, "", routing_key)  # type: ignore[no-untyped-call]
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
        unconfirmed = self._unconfirmed()
        if unconfirmed is not None:
            unconfirmed.publish(outgoing, replace=replace)  # a skip is logged when read
        elif self.store.publish(outgoing, replace=replace) is None:
            logger.info(
                "pgqueue: skipped a message for queue %r: dedup key %r is waiting or running",
                queue,
                outgoing.dedup_key,
            )

    def close(self) -> None:
        if not self._confirm and not self.closed:
            _pipelined.settle(self.store)  # what the server answered is reported
        super().close()  # type: ignore[no-untyped-call]

    # -- consuming -----------------------------------------------------------------

    def basic_consume(
        self, queue: str, no_ack: bool, callback: Any, consumer_tag: str, **kwargs: Any
    ) -> Any:
        check_name("queue", queue)
        result = super().basic_consume(queue, no_ack, callback, consumer_tag, **kwargs)  # type: ignore[no-untyped-call]
        self.consumer.subscribe(queue, self, no_ack)
        return result

    def basic_cancel(self, consumer_tag: str) -> Any:
        queue = self._tag_to_queue.get(consumer_tag)
        result = super().basic_cancel(consumer_tag)  # type: ignore[no-untyped-call]
        if queue is not None and queue not in self._active_queues:
            self.consumer.unsubscribe(queue, self)
        return result

    def _get(self, queue: str, timeout: float | None = None) -> dict[str, Any]:
        got = self.consumer.fetch(queue, 1, self.consumer.no_ack(queue), self)
        if not got:
            raise Empty()
        return codec.payload(got[0])

    def basic_get(self, queue: str, no_ack: bool = False, **kwargs: Any) -> Any:
        check_name("queue", queue)
        got = self.consumer.fetch(queue, 1, no_ack, self)
        if not got:
            return None
        message = self.Message(codec.payload(got[0]), channel=self)  # type: ignore[no-untyped-call]
        if not no_ack:
            self.qos.append(message, message.delivery_tag)
            self.consumer.settler.keep_leases()
        return message


class Transport(virtual.Transport):
    Channel = Channel

    default_port = 5432  # type: ignore[assignment]  # Kombu's base declares None
    driver_type = "pgqueue"
    driver_name = "psycopg"
    polling_interval = 5.0

    implements = virtual.Transport.implements.extend(
        asynchronous=True,
        exchange_type=frozenset(["direct", "topic", "fanout"]),
        heartbeats=False,
    )

    connection_errors = virtual.Transport.connection_errors + CONNECTION_ERRORS
    # Declared, so Kombu's ensure() follows a publish's retry policy through several
    # reconnects (without them it gives up once a reconnect succeeded and the error
    # persists, which a read-only server or a failover makes the rule). Kombu's own
    # OperationalError too: a publisher with no connection yet (new, or collected after
    # a failed publish) connects inside the publish, through Connection.default_channel,
    # whose loop gives up after connect_timeout (Celery's broker_connection_timeout, 4 s)
    # and raises that class; not listed, it ends the publish before its policy began.
    recoverable_connection_errors = connection_errors + (kombu.exceptions.OperationalError,)
    recoverable_channel_errors = ()

    def __init__(self, client: Any, **kwargs: Any) -> None:
        self.options = parse_options(client.transport_options)
        check_failover_list(getattr(client, "alt", None) or [])
        self.unroutable = Unroutable(self.options.unroutable)
        super().__init__(client, **kwargs)  # type: ignore[no-untyped-call]
        self.polling_interval = self.options.polling_interval
        self.consumer = Consumer(
            Store(self._conninfo(), self.options),
            self.options,
            self._hand_up,
            type(self).connection_errors,
        )
        self._driver: LoopDriver | None = None

    @property
    def store(self) -> Store:
        return self.consumer.store

    def _hand_up(self, delivery: Delivery) -> None:
        """A delivery of the consumer's, as Kombu's payload to the queue's callback."""
        self._deliver(codec.payload(delivery), delivery.queue)  # type: ignore[no-untyped-call]

    def driver_version(self) -> str:
        return driver_version()

    def _conninfo(self) -> str:
        return connection_conninfo(self.client, self.options.libpq)

    def establish_connection(self) -> Any:
        conninfo = self._conninfo()
        if conninfo != self.store.conninfo:  # failover switched hosts
            self.consumer.use_store(Store(conninfo, self.options))
        self.store.open(probe=True)  # a host that is down or a standby fails here, at once
        self.store.check_pool()
        self.consumer.reopen()
        return super().establish_connection()  # type: ignore[no-untyped-call]

    def close_connection(self, connection: Any) -> None:
        try:
            super().close_connection(connection)  # type: ignore[no-untyped-call]
        finally:
            self._unregister()
            self.consumer.close()

    def flush_publishes(self, timeout: float | None = None) -> None:
        """Wait until the server answered every unconfirmed publish of this process to
        this schema (``confirm_publish=False``), reporting each (see ``_pipelined``)."""
        _pipelined.flush(self.store, timeout)

    def flush_acks(self) -> None:
        """Send pending acks now, so what this transport reads next reflects them."""
        self.consumer.settler.flush_acks()

    def drain_events(self, connection: Any, timeout: float | None = None, **_: Any) -> None:
        drain(self.consumer, timeout)

    def register_with_event_loop(self, connection: Any, loop: Any) -> None:
        self._unregister()
        self._driver = LoopDriver(self.consumer, loop)
        self._driver.start()

    def unregister_from_event_loop(self, connection: Any, loop: Any) -> None:
        self._unregister()

    def _unregister(self) -> None:
        driver, self._driver = self._driver, None
        if driver is not None:
            driver.stop()

    @cached_property
    def default_connection_params(self) -> dict[str, Any]:
        return {"port": self.default_port, "hostname": None}
