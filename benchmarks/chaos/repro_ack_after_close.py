"""Reproduction: acking (or rejecting) a message after its channel was closed crashes.

    python -m benchmarks.chaos.repro_ack_after_close [DSN]

Celery's consumer closes its channel when the broker connection drops (a database
restart) and opens a new one; a task that was running meanwhile then acks its message
on the old, closed channel. ``QoS.ack`` in kombu_pgqueue/transport.py reads
``self.channel.connection.acks``, and a closed virtual channel has ``connection = None``,
so the ack raises ``AttributeError``. That is not one of the transport's connection or
channel errors, so Celery's ``ack_log_error`` does not catch it: the worker dies with
"Unrecoverable error" (seen in every worker of the dbrestart scenario).

Kombu's own virtual transports (``memory://``) accept the late ack quietly; the message
would come back when its lease ends. This script runs the same steps on both.
"""

from __future__ import annotations

import sys
import uuid

import psycopg
from kombu import Connection, Producer, Queue
from psycopg import sql

import kombu_pgqueue  # noqa: F401 - registers pgqueue://
from kombu_pgqueue.embedded import broker_url


def late(url: str, options: dict[str, object], action: str) -> str:
    with Connection(url, transport_options=options) as conn:
        Producer(conn).publish({"x": 1}, routing_key="q", declare=[Queue("q")])
        channel = conn.channel()
        message = channel.basic_get("q")
        assert message is not None
        channel.close()
        try:
            getattr(message, action)()
        except Exception as exc:  # noqa: BLE001 - the finding
            return f"{type(exc).__name__}: {exc}"
        return "no error"


def main() -> int:
    dsn = sys.argv[1] if len(sys.argv) > 1 else "postgresql://postgres@127.0.0.1:5432/test"
    schema = f"repro_{uuid.uuid4().hex[:8]}"
    failed = False
    try:
        for action in ("ack", "reject", "requeue"):
            expected = late("memory://", {}, action)
            got = late(broker_url(dsn), {"schema": schema}, action)
            print(f"{action} after channel.close(): memory:// -> {expected}; pgqueue:// -> {got}")
            failed |= got != expected
    finally:
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(schema)))
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
