"""A producer that publishes inside its transaction, says so, and waits to be killed.

argv: DSN BROKER_URL SCHEMA QUEUE. Prints ``published <backend pid> <orders seen>
<messages seen>`` (as its own transaction sees them), then blocks on stdin.
"""

from __future__ import annotations

import sys

import psycopg
from kombu import Connection, Producer
from psycopg import sql

import kombu_pgqueue


def main() -> None:
    dsn, broker_url, schema, queue = sys.argv[1:5]
    options = {"schema": schema, "auto_migrate": False}
    with Connection(broker_url, transport_options=options) as broker, psycopg.connect(dsn) as conn:
        # not autocommit: this INSERT opens the transaction the publish joins
        conn.execute(
            sql.SQL("INSERT INTO {} (id) VALUES (7)").format(sql.Identifier(schema, "orders"))
        )
        with kombu_pgqueue.transaction(conn):
            Producer(broker).publish({"order": 7}, routing_key=queue)
        orders = conn.execute(
            sql.SQL("SELECT count(*) FROM {}").format(sql.Identifier(schema, "orders"))
        ).fetchone()
        messages = conn.execute(
            sql.SQL("SELECT count(*) FROM {}").format(sql.Identifier(schema, "message_store"))
        ).fetchone()
        assert orders is not None and messages is not None
        print("published", conn.info.backend_pid, orders[0], messages[0], flush=True)
        sys.stdin.read()  # SIGKILLed here, before any commit


if __name__ == "__main__":
    main()
