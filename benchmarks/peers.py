"""The brokers side by side: pgqueue (its asynchronous-commit and fast variants), Redis, RabbitMQ
(and with publisher confirms), Kombu's SQLAlchemy transport; reaching them, their queues,
and removing everything a run left on them."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import psycopg
from kombu import Connection, Exchange, Queue

import kombu_pgqueue  # noqa: F401 - registers pgqueue://

from .config import Ctx, Settings, log


@dataclass
class Broker:
    name: str
    url: str
    options: dict[str, Any] = field(default_factory=dict)
    #: the URL for a worker that must go through the counting proxy (PostgreSQL only)
    url_via: Callable[[int], str] | None = None
    available: bool = False
    why_absent: str = ""
    version: str = ""


def make_brokers(settings: Settings, prefix: str) -> dict[str, Broker]:
    pgqueue_url = settings.pg_url("pgqueue")
    sqla_url = settings.pg_url("sqla+postgresql+psycopg")
    return {
        "pgqueue": Broker(
            "pgqueue",
            pgqueue_url,
            {"schema": prefix},
            url_via=lambda port: settings.pg_url("pgqueue", via_port=port),
        ),
        # the opt-in trade (transport option synchronous_commit=off): a publish returns
        # before its WAL flush, as Redis without AOF and RabbitMQ without confirms do
        "pgqueue_async": Broker(
            "pgqueue_async",
            pgqueue_url,
            {"schema": f"{prefix}_async", "synchronous_commit": "off"},
            url_via=lambda port: settings.pg_url("pgqueue", via_port=port),
        ),
        # the fast mode: on top of that, a publish does not wait for its statement
        # (confirm_publish=False), as RabbitMQ's default publish does not wait for the broker
        "pgqueue_fast": Broker(
            "pgqueue_fast",
            pgqueue_url,
            {"schema": f"{prefix}_fast", "synchronous_commit": "off", "confirm_publish": False},
            url_via=lambda port: settings.pg_url("pgqueue", via_port=port),
        ),
        # the host's relay (transport option relay): one LISTEN session for a host's
        # consumers, no handoffs, claims in the event loop's thread (not by default:
        # --brokers pgqueue,pgqueue_relay,rabbitmq for what it costs a single worker)
        "pgqueue_relay": Broker(
            "pgqueue_relay",
            pgqueue_url,
            {"schema": f"{prefix}_relay", "relay": True},
            url_via=lambda port: settings.pg_url("pgqueue", via_port=port),
        ),
        "redis": Broker("redis", settings.redis_url),
        "rabbitmq": Broker("rabbitmq", settings.amqp_url),
        # RabbitMQ with publisher confirms: a publish returns once the broker has the
        # message, as a pgqueue publish returns once it is committed (durable queues)
        "rabbitmq_confirm": Broker(
            "rabbitmq_confirm", settings.amqp_url, {"confirm_publish": True}
        ),
        "sqla": Broker(
            "sqla",
            sqla_url,
            # its own schema: Kombu names the tables' indexes without the table name,
            # so two kombu_message tables cannot share a schema
            {"connect_args": {"options": f"-c search_path={prefix}_sqla"}},
            url_via=lambda port: settings.pg_url("sqla+postgresql+psycopg", via_port=port),
        ),
    }


def probe(settings: Settings, broker: Broker) -> None:
    try:
        if broker.name == "sqla":
            with psycopg.connect(settings.dsn, autocommit=True, connect_timeout=3) as conn:
                schema = broker.options["connect_args"]["options"].rpartition("=")[2]
                conn.execute(
                    psycopg.sql.SQL("CREATE SCHEMA IF NOT EXISTS {}").format(
                        psycopg.sql.Identifier(schema)
                    )
                )
        with Connection(broker.url, transport_options=broker.options, connect_timeout=3) as conn:
            conn.ensure_connection(max_retries=1, timeout=5)
            ch = conn.channel()
            q = Queue(f"probe_{uuid.uuid4().hex[:6]}", routing_key="probe")
            q(ch).declare()
            q(ch).delete()
            if broker.name == "rabbitmq":
                props = conn.connection.server_properties
                broker.version = f"RabbitMQ {props.get('version', b'?')}"
        broker.available = True
    except Exception as exc:  # noqa: BLE001 - anything means "not reachable"
        broker.available = False
        broker.why_absent = f"{type(exc).__name__}: {exc}"


# -- queues ----------------------------------------------------------------------------


def kombu_queue(name: str) -> Queue:
    # the queue Celery declares for task_default_queue=name
    return Queue(name, Exchange(name, "direct"), routing_key=name)


def declare(broker: Broker, name: str) -> None:
    with Connection(broker.url, transport_options=broker.options) as conn:
        kombu_queue(name)(conn.channel()).declare()


def delete_queue(broker: Broker, name: str) -> None:
    try:
        with Connection(broker.url, transport_options=broker.options) as conn:
            ch = conn.channel()
            q = kombu_queue(name)(ch)
            try:
                q.purge()
            except Exception:  # noqa: BLE001,S110
                pass
            q.delete()
    except Exception as exc:  # noqa: BLE001
        log(f"warning: could not delete {broker.name} queue {name}: {exc!r}")


def queue_size(broker: Broker, name: str) -> int:
    """Messages waiting in the broker's queue (for pgqueue: delayed ones included)."""
    with Connection(broker.url, transport_options=broker.options) as conn:
        try:
            return int(kombu_queue(name)(conn.channel()).queue_declare(passive=True).message_count)
        except Exception:  # noqa: BLE001 - Redis forgets an empty queue
            return 0


# -- cleanup -----------------------------------------------------------------------------


def close_sqla_sessions() -> None:
    import gc

    from kombu.transport.sqlalchemy import Channel as SqlaChannel
    from sqlalchemy.orm import Session

    for obj in gc.get_objects():
        if isinstance(obj, Session):
            try:
                obj.close()
            except Exception:  # noqa: BLE001,S110
                pass
    for engine, _ in list(SqlaChannel._engines.values()):
        engine.dispose()
    SqlaChannel._engines.clear()


def drop_schema(dsn: str, schema: str) -> None:
    """Drop one of this run's schemas, ending this run's sessions that still lock its tables."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(
            "SELECT pg_terminate_backend(l.pid) FROM pg_locks AS l "
            "JOIN pg_class AS c ON c.oid = l.relation "
            "JOIN pg_namespace AS n ON n.oid = c.relnamespace "
            "WHERE n.nspname = %s AND l.pid <> pg_backend_pid()",
            (schema,),
        )
        conn.execute("SET lock_timeout = '20s'")
        conn.execute(
            psycopg.sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(
                psycopg.sql.Identifier(schema)
            )
        )


def _clean_rabbitmq(ctx: Ctx, name: str, broker: Broker) -> None:
    with Connection(broker.url) as conn:
        ch = conn.channel()
        for q in sorted(ctx.queues.get(name, ())):
            try:
                ch.queue_delete(q)
            except Exception:  # noqa: BLE001
                ch = conn.channel()
        for q in sorted(ctx.queues.get(name, ())):
            try:
                ch.exchange_delete(q)
            except Exception:  # noqa: BLE001
                ch = conn.channel()


def _clean_redis(prefix: str, broker: Broker) -> None:
    import redis as redis_lib

    r = redis_lib.Redis.from_url(broker.url)
    for key in r.scan_iter(count=1000):
        k = key.decode(errors="replace")
        if prefix in k:
            r.delete(key)
        elif k.startswith("_kombu.binding."):
            for member in r.smembers(key):
                if prefix.encode() in member:
                    r.srem(key, member)
    # binding deadlines of exchanges whose bindings are all gone now
    for member in r.zrange(b"_kombu.binding_deadlines", 0, -1):
        if not r.exists(b"_kombu.binding." + member):
            r.zrem(b"_kombu.binding_deadlines", member)
    for field_, val in list(r.hscan_iter(b"unacked")):
        if prefix.encode() in val:
            r.hdel(b"unacked", field_)
            r.zrem(b"unacked_index", field_)


def cleanup(ctx: Ctx) -> None:
    """Stop the workers still running, then remove the run's queues, keys and schemas."""
    for worker in list(ctx.workers):
        try:
            worker.stop(grace=5)
        except Exception as exc:  # noqa: BLE001
            log(f"warning: stopping worker {worker.proc.pid}: {exc!r}")
    prefix = ctx.prefix
    for name, broker in ctx.brokers.items():
        if not broker.available:
            continue
        try:
            if name.startswith("rabbitmq"):
                _clean_rabbitmq(ctx, name, broker)
            elif name == "redis":
                _clean_redis(prefix, broker)
            elif name.startswith("pgqueue"):
                drop_schema(ctx.settings.dsn, broker.options["schema"])
            elif name == "sqla":
                # Kombu's SQLAlchemy channel never closes its session, which stays idle
                # in a transaction (queue_declare's SELECT count(*)) and would block the DROP
                close_sqla_sessions()
                drop_schema(ctx.settings.dsn, f"{prefix}_sqla")
        except Exception as exc:  # noqa: BLE001
            log(f"warning: cleanup of {name} failed: {exc!r}")
